"""The cluster quickstart (docs/quickstart-cluster.md) as its reader runs it, on a two-node Ray cluster.

- The page's code blocks are lines of ``examples/quickstart_train.py``, the script the job runs
  (fast): the page shows the real file.
- Two Ray nodes of one CPU each on this machine (``ray.cluster_utils.Cluster``, as
  ``tests/test_two_nodes.py`` starts them), the job server on the head; the page's
  ``ray job submit`` line runs with the test's address, its ``--out`` in a temporary
  directory, measured plan selection on (the test session turns it off) and an empty plan
  cache, as a first run meets them. Without ``--working-dir``: on one machine the two nodes
  share a session directory and the unpacked copy can vanish under the job
  (``tests/test_two_nodes.py``). The job must find both nodes, print every line of the
  page's "What you see" but the tables' rows (numbers, paths and spacing aside), train,
  evaluate alike on the workers and in the driver, save and load back; the checkpoint and
  the Hugging Face weights it wrote must hold the same tensors. Slow:
  ``python -m pytest -m slow tests/test_quickstart.py``; CI runs it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import two_ray_nodes

REPO = Path(__file__).resolve().parents[1]
PAGE = (REPO / "docs" / "quickstart-cluster.md").read_text()
SCRIPT = REPO / "examples" / "quickstart_train.py"
OUT_ON_PAGE = "/shared/quickstart"


def _blocks(lang: str) -> list[str]:
    return [body for kind, body in re.findall(r"^```(\w*)\n(.*?)^```", PAGE, flags=re.S | re.M) if kind == lang]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_page_shows_the_scripts_own_code():
    script = {line.rstrip() for line in SCRIPT.read_text().splitlines()}
    shown = [line.rstrip() for block in _blocks("python")[:2] for line in block.splitlines() if line.strip()]
    assert shown, "the page shows the training script"
    missing = [line for line in shown if line not in script]
    assert not missing, f"lines the page shows that examples/quickstart_train.py does not have: {missing}"


def _entrypoint(out_dir: Path) -> list[str]:
    """The program of the page's ``ray job submit`` line (after ``--``), its ``--out`` moved to ``out_dir``."""
    line = next(line for block in _blocks("bash") for line in block.splitlines() if "ray job submit" in line)
    words = shlex.split(line.split("#")[0])
    program = words[words.index("--") + 1:]
    assert program[:2] == ["python", "examples/quickstart_train.py"] and OUT_ON_PAGE in program, program
    program[0], program[1] = sys.executable, str(SCRIPT)
    return [str(out_dir) if word == OUT_ON_PAGE else word for word in program]


def _page_output() -> list[str]:
    """The lines of the page's "What you see" that every run prints: not the rows of the plan's and the
    plan selection's tables (a row starts with a digit or a space), whose measured figures and kept
    plan move from run to run."""
    return [line for line in _blocks("text")[0].splitlines() if line.strip() and not line[0].isdigit()
            and not line[0].isspace()]


def _pattern(shown: str, out_dir: Path) -> re.Pattern:
    """A line of the page's output as a pattern: any numbers, any spacing, ``...`` any ending."""
    text = shown.replace(OUT_ON_PAGE, str(out_dir))
    prefix = text.endswith(" ...")
    pattern = re.escape(text.removesuffix(" ...") if prefix else text)
    pattern = re.sub(r"\d+(?:\\\.\d+)?", r"[0-9.]+", pattern)
    pattern = re.sub(r"(?:\\ )+", r"\\s+", pattern)
    # how the evaluation reads the state follows the kept plan (runtime/evaluation.py): in place on
    # the training mesh, moved from the stages of a pipeline, or a copy of its own
    pattern = re.sub(r"\\\((?:alias|moved|own)\\\)", r"\\((?:alias|moved|own)\\)", pattern)
    return re.compile(pattern + ("" if prefix else r"\s*$"))


def _agent_ports() -> dict[str, int]:
    """Free ports for a node's agents: Ray's defaults (the job agent's 52365) are taken when another
    Ray runs on this machine, and the head's job agent then never comes up (``tests/test_ray_job.py``)."""
    names = ("dashboard_agent_listen_port", "metrics_agent_port", "runtime_env_agent_port", "metrics_export_port")
    return {name: _free_port() for name in names}


@pytest.fixture(scope="module")
def two_nodes():
    """Two Ray nodes of one CPU each, this process connected to them; the job server on the head."""
    dash = _free_port()
    for cluster, _ in two_ray_nodes(include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=dash,
                                    **_agent_ports()):
        yield cluster, dash


@pytest.mark.slow
def test_the_quickstart_job_on_two_nodes(two_nodes, tmp_path):
    _, dash = two_nodes
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    first_run = json.dumps({"env_vars": {"ALPA_TORCH_TUNE": "1", "ALPA_TORCH_CACHE": str(tmp_path / "plans")}})
    submit = [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", f"http://127.0.0.1:{dash}",
              "--runtime-env-json", first_run, "--", *_entrypoint(tmp_path)]
    deadline = time.monotonic() + 90
    while True:  # the head's job agent comes up a few seconds after the node; until then nothing is created
        job = subprocess.run(submit, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
        out = job.stdout + job.stderr
        if job.returncode == 0 or "No available agent" not in out or time.monotonic() > deadline:
            break
        time.sleep(3)
    print(out)  # the page's "What you see" comes from here
    assert job.returncode == 0, out[-4000:]
    assert "cluster: 2x1 cluster" in out, out[-4000:]  # the job's driver found both nodes
    absent = [shown for shown in _page_output() if not any(_pattern(shown, tmp_path).search(line)
                                                           for line in out.splitlines())]
    assert not absent, f"lines the page shows that the job did not print: {absent}\n{out[-4000:]}"
    assert " (kept) " in out, "the plan selection's table marks the plan it kept"
    assert len(re.findall(r"^step \d+ loss [0-9.]+$", out, flags=re.M)) == 3, out[-4000:]
    workers, here = map(float, re.search(r"validation loss (\S+) on the workers, (\S+) in this process", out).groups())
    assert workers == pytest.approx(here, abs=1e-5)
    _same_tensors_in_checkpoint_and_weights(tmp_path)


def _same_tensors_in_checkpoint_and_weights(out_dir: Path) -> None:
    """What ``step.save`` and ``step.save_pretrained`` wrote, read in this process, agree."""
    import torch
    from safetensors.torch import load_file

    import alpa_torch
    from alpa_torch.zoo import GPT, GPTConfig

    model_state, optimizer_state = alpa_torch.load_checkpoint(str(out_dir / "checkpoint"))
    index = json.loads((out_dir / "weights" / "model.safetensors.index.json").read_text())
    weights = {}
    for name in sorted(set(index["weight_map"].values())):
        weights.update(load_file(str(out_dir / "weights" / name)))
    parameters = {name for name, _ in GPT(GPTConfig.tiny()).named_parameters()}
    assert parameters <= set(weights) <= set(model_state), (sorted(weights), sorted(model_state))
    for name, tensor in weights.items():
        assert torch.equal(tensor, model_state[name]), name
    assert optimizer_state, "the checkpoint holds AdamW's state"
