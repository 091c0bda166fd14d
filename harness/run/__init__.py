"""Stage 7, run: the case loop every front end shares: the options model (``options``), the run session
(``session``), the runner and its repeats, the parts of a sharded run, the stored selection, and the
one-line argument parser of both command lines (``one_line_parser``).
"""
