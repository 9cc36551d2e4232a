"""Where a logical message's WAL record starts, from where it ends and what it holds.

The streaming protocol gives a non-transactional message with the LSN where its record *ends*; a
peek up to `end` decodes every record that *starts* before `end`, and a slot moved to `end` never
sends again a message whose record started before it. So a window's stream must keep a message
whose record straddles `end` (a byte-limit cut lies on a page boundary, inside long records), and
only the record's start tells. It is found from the record's length (header, data header, the
message struct, prefix and content) and the page headers PostgreSQL put between its bytes.

The length is a lower bound (a replication origin adds a few bytes); that is safe: records start
MAXALIGNed, so a start computed a few bytes late never moves across a page boundary or onto a
record boundary that a start at or past `end` would be on.
"""
from __future__ import annotations

RECORD_HEADER = 24  # XLogRecord
DATA_HEADER_SHORT, DATA_HEADER_LONG = 2, 5  # XLogRecordDataHeaderShort / Long (main data > 255 bytes)
LOGICAL_MESSAGE = 24  # offsetof(xl_logical_message, message)
PAGE_HEADER_SHORT, PAGE_HEADER_LONG = 24, 40  # a page's header; the long one opens a WAL segment


def message_record_length(prefix: bytes, content_length: int) -> int:
    """The bytes (page headers left out) of the WAL record of a logical message, at least."""
    main = LOGICAL_MESSAGE + len(prefix) + 1 + content_length
    return RECORD_HEADER + (DATA_HEADER_SHORT if main <= 255 else DATA_HEADER_LONG) + main


def starts_before(record_end: int, length: int, end: int, page: int, segment: int) -> bool:
    """Whether a record of `length` bytes that ends at `record_end` started before `end`: its bytes
    at or after `end` (page headers left out) are fewer than its length."""
    if record_end <= end:
        return True
    after = 0
    page_start = end - end % page
    while page_start < record_end and after < length:
        header = PAGE_HEADER_LONG if page_start % segment == 0 else PAGE_HEADER_SHORT
        after += max(0, min(record_end, page_start + page) - max(end, page_start + header))
        page_start += page
    return after < length
