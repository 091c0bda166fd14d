"""Stage 6, collect: the records written as they come (``collector``), what an engine is known to get wrong
(``expectations``) and what a certificate covered (``coverage``).
"""
