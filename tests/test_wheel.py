"""The package stands on its own: a wheel, a fresh virtual environment, an empty directory.

Builds the wheel (``pip wheel . --no-deps``), installs it with its dependencies into a new
virtual environment outside the repository, and runs the CLI from an empty directory: the
demo training (``train --local 1x2 --steps 3 --check``) and a GPT-3 1.3B plan on 16
simulated V100s. Nothing may come from ``tests/``, ``bench/`` or the source tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(args, cwd, env, timeout=900):
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    command = " ".join(map(str, args))
    assert out.returncode == 0, f"{command} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_the_installed_wheel_runs_from_an_empty_directory(tmp_path):
    import torch

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "RAY_ADDRESS")}
    env.update(HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w", str(wheels), "-q"], REPO, env)
    wheel = next(wheels.glob("alpa_torch-*.whl"))
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    pip, exe = venv / "bin" / "pip", venv / "bin" / "alpa-torch"
    torch_version = torch.__version__.split("+")[0]
    _run([str(pip), "install", "-q", f"torch=={torch_version}"], tmp_path, env)
    _run([str(pip), "install", "-q", str(wheel)], tmp_path, env)
    empty = tmp_path / "empty"
    empty.mkdir()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    found = _run([str(venv / "bin" / "python"), "-c", "import alpa_torch, runtime; print(alpa_torch.__file__)"],
                 empty, env)
    assert str(venv) in found.stdout and str(REPO) not in found.stdout, found.stdout
    trained = _run([str(exe), "train", "--local", "1x2", "--steps", "3", "--check"], empty, env)
    assert "max |loss - eager loss|" in trained.stdout and "(ok," in trained.stdout, trained.stdout
    planned = _run([str(exe), "plan", "gpt-1.3b", "--cluster", "2x8", "--device", "v100-16gb"], empty, env)
    assert planned.stdout.splitlines()[0].split()[:3] == ["stage", "layers", "submesh"], planned.stdout
    assert list(empty.iterdir()) == [], "the CLI wrote into the working directory"
