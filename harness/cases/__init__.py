"""Stage 1, cases: what a case is and what its record says, the vocabulary every later stage speaks:
``CaseConfig`` and its axes (``case``), dtype names (``dtypes``), capability rules (``capabilities``), the model
zoo (``model_protocol``, ``models``) and the verdicts and ``CaseRecord`` (``records``).
"""
