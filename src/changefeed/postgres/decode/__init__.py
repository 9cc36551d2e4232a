"""pgoutput bytes -> change rows, without I/O: the message decoder (`pgoutput`), the block parser
of plain changes (`tuple_block`), the change builder that applies the window rule and makes Arrow
record batches (`builder`, with its `rows` and `columns`).

Nothing is re-exported here: the planner imports `pgoutput` alone, and `builder` brings numpy
and Arrow, which only the executors that read need.
"""
