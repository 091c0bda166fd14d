"""Training parity is the harness library's: the parity optimizer, the local reference's all-rank batch,
the DDP reference and the loop that trains an engine beside a reference (``harness.engines.optim``,
``harness.engines.references``, ``harness.compare.parity``; a suite runs cases through the plugin's ``parity_runner``).
No suite, report, example, engine module or front end builds its own.

Found by syntax, not by name:

- the parity optimizer by hand: ``SGD`` with momentum, or ``AdamW``, given no keyword but the
  hyperparameters ``harness.engines.optim.sgd`` and ``harness.engines.optim.adamw`` take (an optimizer with other
  keywords, such as ``foreach``, or plain SGD without momentum is a check's own and is left alone);
- a local reference's batch by hand: a loop or comprehension that calls ``get_input(rank=r)`` for each
  ``r`` it iterates (``harness.engines.references.all_rank_batch`` concatenates every rank's batch);
- a parity loop: a loop that steps an optimizer and runs backward for two models, by two ``.backward()``
  calls in its body or one inside a loop over a literal tuple or list of tuples (``(model, optimizer)``
  pairs);
- a DDP reference by hand: a module that constructs ``DistributedDataParallel`` (or ``DDP``) and steps an
  optimizer (``harness.engines.references.build_ddp`` is the DDP reference).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: every directory above the harness library that holds Python source.
SCANNED = ("engine", "suites", "reports", "examples", "harness/cli", "harness/pytest_plugin", "harness/conformance")
#: the hyperparameters the harness's factories take, per optimizer class.
FACTORY_KEYWORDS = {"SGD": {"lr", "momentum"}, "AdamW": {"lr", "betas", "eps", "weight_decay"}}
#: ``path: why it builds its own`` (each entry must still be needed).
ALLOWED = {
    "harness/conformance/mixed_precision/precision_logic.py": "plain data-parallel training by hand is the oracle "
    "the local reference is tested against",
    "harness/conformance/seeds/orig_params_ddp.py": "the torch test's checks against DDP cross optimizers the case's "
    "optimizer axis does not express (the Adam family with and without foreach, per-group hyperparameters, "
    "set_to_none=False, frozen parameters)",
    "harness/conformance/seeds/fsdp_use_orig_params.py": "parameter and gradient writeback, and engine twins "
    "compared with each other",
}


def _is_parity_optimizer(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in FACTORY_KEYWORDS:
        return False
    keywords = {k.arg for k in call.keywords}
    if None in keywords or not keywords <= FACTORY_KEYWORDS[name]:
        return False
    return name != "SGD" or "momentum" in keywords


def _reads_every_rank(node: ast.AST, variable: str) -> bool:
    """``node`` calls ``get_input`` with ``rank=variable``."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get_input":
            if any(k.arg == "rank" and isinstance(k.value, ast.Name) and k.value.id == variable for k in n.keywords):
                return True
    return False


def _all_rank_batches(tree: ast.AST) -> list[int]:
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.ListComp, ast.GeneratorExp, ast.SetComp, ast.DictComp)):
            if any(isinstance(g.target, ast.Name) and _reads_every_rank(n, g.target.id) for g in n.generators):
                lines.append(n.lineno)
        elif isinstance(n, ast.For) and isinstance(n.target, ast.Name):
            if any(_reads_every_rank(statement, n.target.id) for statement in n.body):
                lines.append(n.lineno)
    return lines


def _calls(node: ast.AST, attr: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr]


def _parity_loops(tree: ast.AST) -> list[int]:
    """Loops that step an optimizer and run backward for two models (the outermost such loop only)."""
    lines: list[int] = []
    inner: set[int] = set()
    for n in ast.walk(tree):
        if not isinstance(n, (ast.For, ast.While)) or id(n) in inner or not _calls(n, "step"):
            continue
        pairs = [m for m in ast.walk(n) if isinstance(m, ast.For) and isinstance(m.iter, (ast.Tuple, ast.List))
                 and len(m.iter.elts) >= 2 and all(isinstance(e, ast.Tuple) for e in m.iter.elts) and _calls(m, "backward")]
        if len(_calls(n, "backward")) >= 2 or pairs:
            lines.append(n.lineno)
            inner.update(id(m) for m in ast.walk(n) if m is not n)
    return lines


def _ddp_by_hand(tree: ast.AST) -> list[int]:
    """Constructions of ``DistributedDataParallel``, where the module also steps an optimizer."""
    built = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
             and (n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")) in ("DDP", "DistributedDataParallel")]
    return built if built and _calls(tree, "step") else []


def own_parity_pieces(root: Path, directories: tuple[str, ...]) -> dict[str, list[str]]:
    """``{path relative to root: ["line N: what"]}`` of every module under ``directories`` that builds the
    parity optimizer or an all-rank batch itself."""
    found: dict[str, list[str]] = {}
    for directory in directories:
        for path in sorted((root / directory).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            what = [f"line {n.lineno}: the parity optimizer (harness.engines.optim)" for n in ast.walk(tree)
                    if isinstance(n, ast.Call) and _is_parity_optimizer(n)]
            what += [f"line {line}: every rank's batch (harness.engines.references.all_rank_batch)" for line in _all_rank_batches(tree)]
            what += [f"line {line}: a parity loop (a harness case: parity_runner)" for line in _parity_loops(tree)]
            what += [f"line {line}: a DDP reference (harness.engines.references.build_ddp)" for line in _ddp_by_hand(tree)]
            if what:
                found[path.relative_to(root).as_posix()] = sorted(what, key=lambda entry: int(entry.split()[1].rstrip(":")))
    return found


def test_planted_pieces_are_found(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "planted.py").write_text(
        "import torch\n"
        "opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)\n"
        "batch = [m.get_input(step=0, rank=r) for r in range(2)]\n"
        "for r in range(2):\n"
        "    x = m.get_input(step=0, rank=r)\n"
        "adamw = torch.optim.AdamW(params, lr=1e-2)\n"
    )
    (tmp_path / "pkg" / "own.py").write_text(
        "import torch\n"
        "plain = torch.optim.SGD(params, lr=0.1)\n"
        "ported = torch.optim.SGD(params, lr=5e-3, momentum=0.9, foreach=True)\n"
        "adam = torch.optim.Adam(params, lr=1e-2)\n"
        "mine = m.get_input(step=0, rank=rank)\n"
    )
    found = own_parity_pieces(tmp_path, ("pkg",))
    assert list(found) == ["pkg/planted.py"], found
    assert [entry.split(":")[0] for entry in found["pkg/planted.py"]] == ["line 2", "line 3", "line 4", "line 6"]


def test_planted_parity_loops_and_ddp_references_are_found(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "loops.py").write_text(
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "def side_by_side(model, ref, opt, ref_opt, x):\n"
        "    for step in range(3):\n"
        "        loss(model(x)).backward()\n"
        "        loss(ref(x)).backward()\n"
        "        opt.step()\n"
        "        ref_opt.step()\n"
        "def in_turn(model, opt, x):\n"
        "    ref = DDP(copy(model))\n"
        "    for step in range(3):\n"
        "        for m, o in ((model, opt), (ref, sgd(ref))):\n"
        "            loss(m(x)).backward()\n"
        "            o.step()\n"
    )
    # One model trained, two compared without an optimizer step, DDP's gradients without a step: none is parity.
    (tmp_path / "pkg" / "alone.py").write_text(
        "def train(model, opt, x):\n"
        "    for step in range(3):\n"
        "        loss(model(x)).backward()\n"
        "        opt.step()\n"
        "def twins(a, b, x):\n"
        "    for m in (a, b):\n"
        "        loss(m(x)).backward()\n"
        "def settings(make, opt, x):\n"
        "    for orig in (False, True):\n"
        "        loss(make(orig)(x)).backward()\n"
        "        opt.step()\n"
    )
    (tmp_path / "pkg" / "ddp_grads.py").write_text(
        "from torch.nn.parallel import DistributedDataParallel\n"
        "def grads_only(model, x):\n"
        "    return DistributedDataParallel(model)(x).sum().backward()\n"
    )
    found = own_parity_pieces(tmp_path, ("pkg",))
    assert list(found) == ["pkg/loops.py"], found
    assert found["pkg/loops.py"] == [
        "line 3: a parity loop (a harness case: parity_runner)",
        "line 9: a DDP reference (harness.engines.references.build_ddp)",
        "line 10: a parity loop (a harness case: parity_runner)",
    ]


def test_no_parity_piece_outside_the_harness_library() -> None:
    found = own_parity_pieces(ROOT, SCANNED)
    unexplained = {path: what for path, what in found.items() if path not in ALLOWED}
    assert not unexplained, f"build these with the harness library instead: {unexplained}"
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"ALLOWED names modules that no longer build their own (remove them): {stale}"
