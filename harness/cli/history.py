"""``python -m harness history DIR... --out DIR``: the trend page over several nightlies.

An alias of ``python -m reports history``: the same arguments and the one implementation
(``reports.__main__.run``; the page itself is ``reports.history``'s: verdicts and worst ratio per engine
per night, when each failing case first failed, fixes and regressions with their nights, performance
ratios), given the harness's command name next to ``run`` and ``nightly``.
"""

from __future__ import annotations

from reports.__main__ import add_history_arguments as add_arguments
from reports.__main__ import run as main

__all__ = ["add_arguments", "main"]
