"""pgoutput bytes -> change rows, without I/O: the message decoder and the one reading of a
change's layout (`pgoutput`), COPY lines of one tuple (`tuple_lines`) and of a block's plain
changes at once (`tuple_block`), and the change builder that applies the window rule and makes
Arrow record batches (`builder`, with its `rows` and their `columns`).

Nothing is re-exported here: the planner imports `pgoutput` alone, and `builder` brings numpy
and Arrow, which only the executors that read need.
"""
