"""The demo as a Ray job: ``ray start --head`` on 127.0.0.1, ``ray job submit``, check the losses.

Slow (a fresh Ray head, a job with a working-dir upload) and it stops every
Ray process of this user at the end, so it runs apart: ``pytest -m slow``.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray(args, env, timeout):
    return subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_demo_runs_as_a_ray_job(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    gcs, dash = _free_port(), _free_port()
    # Every agent port free too: Ray's defaults (e.g. the job agent's 52365) are taken when
    # another Ray runs on this machine, such as the test session's own, and the head's job
    # agent then never comes up ("No available agent to submit job").
    agents = [(flag, str(_free_port())) for flag in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                                                     "--runtime-env-agent-port", "--metrics-export-port")]
    started = _ray(["start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
                    "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash), "--num-cpus", "2",
                    *[x for pair in agents for x in pair],
                    "--include-dashboard", "true", "--disable-usage-stats"], env, 120)
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        # The head's job agent starts a few seconds after `ray start` returns; until then a
        # submission is refused ("No available agent to submit job") and nothing was created.
        deadline = time.monotonic() + 90
        while True:
            job = _ray(["job", "submit", "--address", f"http://127.0.0.1:{dash}", "--working-dir", ".", "--",
                        "python", "examples/train_gpt.py", "--steps", "3", "--check"], env, 600)
            out = job.stdout + job.stderr
            if job.returncode == 0 or "No available agent" not in out or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert job.returncode == 0, out[-3000:]
        losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", out)]
        assert len(losses) == 3 and all(0 < v < 10 for v in losses), out[-3000:]
        diff = float(re.search(r"max \|loss - eager loss\| = (\S+)", out).group(1))
        assert diff < 1e-5
    finally:
        _ray(["stop", "--force"], env, 120)
