"""``alpa-torch bench NAME [ARGS]``: run one of the benchmark scripts of a source checkout's ``bench/``.

Owns finding the scripts (the current directory's ``bench/``, else the one an editable
install points to; a wheel has none), listing them with the first line of each docstring,
and running one in this interpreter. Does not own the benchmarks themselves.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .workloads import REPO_ROOT, UsageError


def bench_scripts() -> dict[str, Path]:
    """The scripts of ``bench/``: a source checkout's (the current directory's, else the one an
    editable install points to). A wheel does not install them."""
    folder = next((f for f in (Path.cwd() / "bench", REPO_ROOT / "bench") if (f / "_common.py").is_file()), None)
    return {p.stem: p for p in sorted(folder.glob("*.py")) if not p.name.startswith("_")} if folder else {}


def bench_help() -> str:
    import ast

    lines = ["Run a benchmark script from bench/ (its arguments follow NAME; `alpa-torch bench NAME --help`",
             "shows them). Each prints one JSON line per case.", "", "benchmarks:"]
    for name, path in bench_scripts().items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        lines.append(f"  {name:20s} {doc.splitlines()[0] if doc else ''}")
    return "\n".join(lines)


def cmd_bench(args) -> int:
    import subprocess

    scripts = bench_scripts()
    if args.list or not args.name:
        print(bench_help())
        return 0
    if args.name not in scripts:
        raise UsageError(f"unknown benchmark {args.name!r}: use one of {', '.join(scripts)}" if scripts else
                         "the benchmarks are not installed with the package: run alpa-torch bench from a source "
                         "checkout of alpa-torch (its bench/ folder)")
    return subprocess.call([sys.executable, str(scripts[args.name]), *args.args])
