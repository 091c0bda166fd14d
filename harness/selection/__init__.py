"""Stage 4, selection: which cases run: the matrix generators over the registered engines (``matrix``) and the
sample order a limit or time budget takes a prefix of (``sampling``).
"""
