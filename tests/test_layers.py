"""Imports go one way: every module's imports, read with ``ast`` (function-level ones too).

The layers, bottom-up (``docs/architecture.md`` walks them in this order):

0. ``alpa_torch.core``  plain data and pure functions: errors, ``Cluster``, ``OpGraph``, specs,
   ``ParallelPlan``, ``PlanOptions``, the ``alpa::grad`` operator, schedules, partitions
1. capture            ``alpa_torch.capture`` and what it uses: the step as one graph
2. ``intra_ilp``        the sharding ILP of a stage
3. ``stage_dp``         layers, the stage DP, memory simulation, planning
4. ``runtime``          Ray workers, execution, profiling, checkpoints
5. the public face    ``parallelize``, the CLI, explain, viz, progress, workloads, the zoo

A module may import its own layer or any below it, never one above, and no two modules
may import each other in a cycle. There is no exceptions list.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("alpa_torch", "intra_ilp", "stage_dp", "runtime")
CAPTURE = {"alpa_torch.capture", "alpa_torch.optim", "alpa_torch.batch", "alpa_torch.masked_mean",
           "alpa_torch.grouped_mm", "alpa_torch.tracing", "alpa_torch.capture_forward", "alpa_torch.lazy_scalars"}
LAYER_NAMES = ("core", "capture", "intra_ilp", "stage_dp", "runtime", "public face")


def layer(module: str) -> int:
    if module == "alpa_torch.core" or module.startswith("alpa_torch.core."):
        return 0
    if module in CAPTURE:
        return 1
    top = module.split(".")[0]
    if top in ("intra_ilp", "stage_dp", "runtime"):
        return {"intra_ilp": 2, "stage_dp": 3, "runtime": 4}[top]
    return 5


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``module`` imports, anywhere in the file."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import mod`` imports the module; ``from pkg import name`` the package
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


def test_imports_point_down():
    wrong = [f"{m} ({LAYER_NAMES[layer(m)]}) imports {t} ({LAYER_NAMES[layer(t)]})"
             for m, targets in graph().items() for t in sorted(targets)
             if layer(t) > layer(m) and not (m == "alpa_torch" and layer(t) == 5)]
    assert not wrong, "imports that point up a layer:\n" + "\n".join(wrong)


def test_no_import_cycles():
    g = graph()
    g.pop("alpa_torch", None)  # the package's lazy re-exports of the public face
    for package in PACKAGES:  # a package's __init__ is its own face, not an edge of its modules
        for targets in g.values():
            targets.discard(package)
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(g.get(m, ())):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]) if t in path else f"{m} -> {t}")
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_bottom_layer_needs_no_ray_no_pyomo_no_numba():
    heavy = ("ray", "pyomo", "highspy", "numba")
    found = []
    for m, path in modules().items():
        if layer(m) == 0:
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{m} imports {n}" for n in names if n.split(".")[0] in heavy]
    assert not found, found
