"""``torch.compile`` as a case applies it (``CaseConfig.compile``), done so that it really compiles.

The engine's wrapped model runs under ``torch.compile``: the ``aot_eager`` backend on CPU (inductor
takes about a minute per tiny graph on two cores; ``aot_eager`` still traces with Dynamo and AOTAutograd),
inductor on GPUs. Dynamo's caches and counters are cleared per case, and the case asserts that some graph
was compiled: a silent fallback to eager (a graph break on every frame, a warm pool past the recompile
limit) would otherwise pass as a compiled case. The graph and graph-break counts go into the record's
notes, so engines can be compared on them. References run eagerly: compiling does not change the maths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.nn as nn

from harness.compare.trace import wrapper_code

__all__ = ["CompileCounts", "backend_for", "check_compiled", "compile_module", "compiled_counts"]


def backend_for(device_type: str) -> str:
    """The backend a compiled case uses on ``device_type``."""
    return "inductor" if device_type == "cuda" else "aot_eager"


def compile_module(module: nn.Module, device_type: str) -> nn.Module:
    """``module`` under ``torch.compile`` with Dynamo's state and counters reset (a fresh process's)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch._dynamo.eval_frame.skip_code(wrapper_code())
    return torch.compile(module, backend=backend_for(device_type))


@dataclass(frozen=True)
class CompileCounts:
    """What Dynamo compiled since ``compile_module``."""

    graphs: int
    graph_breaks: int
    #: the distinct graph-break reasons, for the note.
    reasons: tuple[str, ...]

    def note(self, backend: str) -> str:
        why = f" ({'; '.join(self.reasons[:3])})" if self.reasons else ""
        return f"compile ({backend}): {self.graphs} graphs, {self.graph_breaks} graph breaks{why}"

    @classmethod
    def from_notes(cls, notes: list[str]) -> "CompileCounts | None":
        """The counts a record's notes hold (``note``'s text; the reasons are not read back), or None
        where no note is a compile note."""
        for text in notes:
            found = re.match(r"compile \([^)]*\): (\d+) graphs, (\d+) graph breaks", text)
            if found:
                return cls(int(found.group(1)), int(found.group(2)), ())
        return None


def compiled_counts() -> CompileCounts:
    """The graphs and graph breaks Dynamo counted since the last ``compile_module``."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return CompileCounts(int(counters["stats"]["unique_graphs"]), int(sum(breaks.values())), tuple(sorted(breaks)))


def check_compiled(counts: CompileCounts) -> None:
    """Raise when nothing was compiled: the case would otherwise pass on eager execution."""
    if counts.graphs < 1:
        raise RuntimeError(
            f"compile: Dynamo compiled no graph ({counts.graph_breaks} graph breaks: {list(counts.reasons)[:3]}); "
            "the engine ran eagerly, so this is not a compiled case"
        )
