"""The README as a new user reads it: its two commands are what CI runs, and its code runs.

- The first code block's two commands (install + demo, install + tests) are lines of
  ``.ci/run``, exactly, so the README and CI can never drift apart.
- Every ``python`` code block runs, in order, in one namespace (a later block may use
  what an earlier one defined, as a reader would), on a local Ray cluster.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _blocks(lang: str | None = None) -> list[str]:
    """Fenced code blocks of the README (of language ``lang``; None: every block)."""
    blocks = re.findall(r"^```([a-z]*)\n(.*?)^```", README, flags=re.S | re.M)
    return [body for kind, body in blocks if lang is None or kind == lang]


def readme_commands() -> list[str]:
    """The README's first code block: the new user's two commands (comments and blanks dropped)."""
    lines = [line.strip() for line in _blocks()[0].splitlines()]
    return [line for line in lines if line and not line.startswith("#")][:2]


def test_readme_opens_with_the_two_commands():
    install_demo, install_tests = readme_commands()
    assert "examples/train_gpt.py --check" in install_demo and "pip install" in install_demo
    assert install_tests.endswith("python -m pytest") and '".[dev]"' in install_tests


def test_ci_runs_the_readme_commands_exactly():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    for command in readme_commands():
        assert command in (line.strip() for line in ci), (
            f"the README's command {command!r} is not a line of .ci/run: CI must run it exactly as written")
    assert any("venv" in line for line in ci), ".ci/run must build a fresh virtual environment"


def test_readme_says_how_long_the_commands_take():
    opening = README.split("## ", 1)[0]
    assert re.search(r"\d+ min", opening), "the README's opening says how long each command takes on 2 cores"


@pytest.mark.usefixtures("ray_session")
def test_readme_python_samples_run():
    blocks = _blocks("python")
    assert blocks, "the README has python samples"
    namespace: dict = {"__name__": "readme"}
    for code in blocks:
        exec(compile(code, "README.md", "exec"), namespace)  # the README's own samples
    import torch

    assert torch.isfinite(namespace["loss"]) and namespace["loss"].dim() == 0
    trained = namespace["decorated_step"]
    assert trained.plan is not None and trained.engine is None  # planned, ran, shut down
