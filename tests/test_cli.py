"""The ``alpa-torch`` command line, run as a user runs it: a subprocess of the entry point.

Every command is run end to end (``plan``, ``explain``, ``train``, ``profile``,
``bench``); ``--help`` of each is checked for its options; bad arguments must give
exit status 2 and one line on stderr, never a traceback. The explanation maths
(``alpa_torch.explain``) and the progress renderers (``alpa_torch.progress``) are
tested in-process. ``train`` and ``profile`` start their own Ray (~25 s each).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from alpa_torch.core.plan import ParallelPlan

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m alpa_torch.cli ARGS`` (the entry point's module) with stdout a pipe, not a terminal."""
    return subprocess.run([sys.executable, "-m", "alpa_torch.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=ENV, timeout=timeout)


def check_png(path: Path) -> None:
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1024, f"{path}: {len(data)} bytes, header {data[:8]!r}"


# ------------------------------------------------------------------ help and bad arguments
def test_entry_point_is_installed():
    exe = shutil.which("alpa-torch")
    if exe is None:
        pytest.skip("alpa-torch is not on PATH (pip install -e . puts it there)")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode == 0 and "plan" in out.stdout and "explain" in out.stdout


@pytest.fixture
def run_main(capsys):
    """``alpa_torch.cli.main(argv)`` in this process: (exit status, stdout, stderr); logger levels restored."""
    import logging

    from alpa_torch.cli import main

    levels = {name: logging.getLogger(name).level for name in logging.root.manager.loggerDict}
    root = logging.getLogger().level

    def run(*args: str):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code
        out = capsys.readouterr()
        return code, out.out, out.err

    yield run
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger().setLevel(root)


@pytest.mark.parametrize("command, options", [
    ("plan", ["--cluster", "--cluster-json", "--local", "--device", "--intra", "--inter", "--out", "--png",
              "--trace", "--microbatches", "--stages", "--memory-gib", "--quiet", "hf-bert", "MODULE:FUNCTION"]),
    ("explain", ["PLAN.json", "--top", "--png", "binding constraint"]),
    ("train", ["--local", "--address", "--steps", "--check", "--plan", "--quiet"]),
    ("profile", ["--out", "--quick", "--repeats", "--address"]),
    ("bench", ["plan_gpt", "stage_dp_kernels", "--list"]),
])
def test_help_is_complete(run_main, command, options):
    code, out, _ = run_main(command, "--help")
    assert code == 0
    text = " ".join(out.split())
    missing = [o for o in options if o not in text]
    assert not missing, f"{command} --help lacks {missing}:\n{out}"


BAD_ARGUMENTS = [
    ([], "required: COMMAND"),
    (["plan"], "required: MODEL"),
    (["plan", "mlp", "--cluster", "2y4"], "'2y4' is not HOSTSxDEVICES"),
    (["plan", "mlp", "--cluster", "1x2", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["plan", "mlp", "--device", "v100-16gb"], "give --cluster"),
    (["plan", "mlp", "--local", "1x2", "--cluster", "1x2"], "not allowed with"),
    (["plan", "nosuch-model"], "unknown model 'nosuch-model'"),
    (["plan", "gpt-3b"], "GPT-3 sizes are"),
    (["plan", "mlp", "--stages", "0"], "'0' is not a positive integer"),
    (["plan", "mlp", "--local", "1x2", "--stages", "5"], "num_stages=5"),
    (["plan", "mlp", "--local", "1x2", "--microbatches", "3"], "does not divide the batch size 8"),
    (["plan", "missing.py:build"], "no file 'missing.py'"),
    (["plan", "mlp", "--model-arg", "oops"], "is not KEY=VALUE"),
    (["explain", "no-such-plan.json"], "no such file"),
    (["train", "gpt-1.3b"], "meta device"),
    (["bench", "no_such_bench"], "unknown benchmark"),
    (["profile", "--local", "1x2"], "required: --out"),
]


@pytest.mark.parametrize("args, says", BAD_ARGUMENTS)
def test_bad_arguments_give_one_line_and_exit_2(run_main, args, says):
    code, _, err = run_main(*args)
    assert code == 2, (code, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and says in lines[0], err


def test_bad_arguments_through_the_entry_point():
    for args, says in (BAD_ARGUMENTS[2], BAD_ARGUMENTS[9]):
        out = cli(*args, timeout=120)
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        assert out.returncode == 2 and len(lines) == 1 and says in lines[0], out.stderr
        assert "Traceback" not in out.stderr


@pytest.mark.parametrize("args, module, extra", [
    (["plan", "hf-gpt2", "--local", "1x2"], "transformers", "hf"),
    (["plan", "mlp", "--local", "1x2", "--png", "plan.png"], "matplotlib", "plot"),
])
def test_a_missing_extra_is_named_in_one_line(run_main, monkeypatch, tmp_path, args, module, extra):
    """Without an optional package the CLI names the extra to install, before any work, no traceback."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(*args)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 1 and len(lines) == 1, err
    assert f'pip install "alpa-torch[{extra}]"' in lines[0] and module in lines[0], err
    assert "Traceback" not in err and not out


# ------------------------------------------------------------------ plan and explain
@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """``plan mlp`` forced into 2 stages x 4 microbatches with every output file."""
    d = tmp_path_factory.mktemp("plan")
    out = cli("plan", "mlp", "--local", "1x2", "--stages", "2", "--microbatches", "4", "--out", "plan.json",
              "--png", "plan.png", "--trace", "trace.json", cwd=d)
    assert out.returncode == 0, out.stderr
    return d, out


def test_plan_prints_table_and_writes_files(planned):
    d, out = planned
    assert out.stdout.splitlines()[0].split()[:3] == ["stage", "layers", "submesh"]
    assert "step " in out.stdout and "microbatches" in out.stdout
    assert "ILPs" not in out.stderr, "no progress bar when stdout is not a terminal"
    plan = ParallelPlan.from_json(d / "plan.json")
    assert len(plan.stages) == 2 and plan.num_microbatches == 4
    alts = plan.options["alternatives"]
    assert alts and {"label", "summary", "predicted_step_s", "peak_memory_bytes", "fits"} <= set(alts[0])
    assert any(a["memory_unlimited"] for a in alts) and any(a["num_stages"] == 1 for a in alts)
    check_png(d / "plan.png")
    trace = json.loads((d / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    # 2 devices (one per stage) x (4 forwards + 4 backwards + 1 update)
    assert len(spans) == 2 * 9 and {e["cat"] for e in spans} == {"forward", "backward", "update"}


def test_explain_reports_time_memory_constraint_and_runner_ups(planned):
    d, _ = planned
    out = cli("explain", "plan.json", "--png", "again.png", cwd=d)
    assert out.returncode == 0, out.stderr
    for needle in ("Time per stage", "bubble ms", "headroom GiB", "Binding constraint: ", "Runner-ups",
                   "Slowest stage"):
        assert needle in out.stdout, f"{needle!r} missing:\n{out.stdout}"
    assert "none recorded" not in out.stdout
    check_png(d / "again.png")


@pytest.mark.sweep
def test_explain_recomputes_runner_ups_for_a_plan_without_them(tmp_path):
    assert cli("plan", "mlp", "--local", "1x2", "--no-alternatives", "-q", "--out", "bare.json",
               cwd=tmp_path).returncode == 0
    assert "alternatives" not in ParallelPlan.from_json(tmp_path / "bare.json").options
    bare = cli("explain", "bare.json", cwd=tmp_path)
    assert bare.returncode == 0 and "none recorded" in bare.stdout and "heuristic" in bare.stdout
    again = cli("explain", "bare.json", "mlp", "-q", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "none recorded" not in again.stdout and "heuristic" not in again.stdout
    wrong = cli("explain", "bare.json", "mlp", "--batch", "4", "-q", cwd=tmp_path)
    assert wrong.returncode == 2 and "is not the graph" in wrong.stderr


def test_plan_simulated_gpu_cluster_and_user_function(tmp_path):
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "def step(model, opt, batch):\n"
        "    opt.zero_grad(); loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])\n"
        "    loss.backward(); opt.step(); return loss\n"
        "def build(width=16):\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)\n"
        "    return model, opt, (torch.randn(16, 8), torch.randn(16, 4)), step\n")
    out = cli("plan", "mymodel.py:build", "--model-arg", "width=32", "--cluster", "1x4", "--device", "v100-16gb",
              "--intra", "nvlink2", "--inter", "eth-25g", "--out", "p.json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "v100-16gb" in out.stdout and "nvlink2" in out.stdout
    assert ParallelPlan.from_json(tmp_path / "p.json").cluster["devices_per_host"] == 4


def test_plan_with_checkpointing_and_precision_options(run_main):
    code, out, _ = run_main("plan", "mlp", "--local", "1x2", "--checkpointing", "full", "--precision", "bf16",
                            "--no-alternatives", "-q")
    assert code == 0 and "recompute" in out
    rows = [line.split() for line in out.splitlines()[1:] if line[:1].isdigit()]
    assert rows and all(r[-1] != "-" for r in rows)  # every stage recomputes its layers
    code, _, err = run_main("plan", "mlp", "--checkpointing", "sometimes")
    assert code == 2 and "is not auto, none, full or a number of GiB" in err


# ------------------------------------------------------------------ train, profile, bench
@pytest.mark.slow
def test_train_local_cluster_checks_against_eager(tmp_path):
    out = cli("train", "mlp", "--local", "1x2", "--steps", "3", "--check", "--trace", "step.json", cwd=tmp_path,
              timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 0 loss" in out.stdout and "step 2 loss" in out.stdout and "samples/s" in out.stdout
    assert "max |loss - eager loss|" in out.stdout and "(ok," in out.stdout
    quiet_lines = [ln for ln in out.stdout.splitlines() if ln.startswith("stage ")]
    assert quiet_lines, "the plan table is printed after training"
    # --trace: the last step as measured on both devices, and the prediction beside it
    measured = json.loads((tmp_path / "step.json").read_text())
    assert {e["tid"] for e in measured["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert measured["otherData"]["source"].endswith("(measured)")
    assert json.loads((tmp_path / "step.predicted.json").read_text())["otherData"]["source"].endswith("(predicted)")


@pytest.mark.sweep
def test_profile_writes_a_cluster_the_planner_reads(tmp_path):
    out = cli("profile", "--local", "1x2", "--quick", "--out", "cluster.json", cwd=tmp_path, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "profiled" in out.stdout
    from alpa_torch import Cluster

    cluster = Cluster.from_json(tmp_path / "cluster.json")
    assert cluster.profiled and cluster.num_devices == 2
    plan = cli("plan", "mlp", "--cluster-json", "cluster.json", "-q", cwd=tmp_path)
    assert plan.returncode == 0 and "profiled" in plan.stdout, plan.stderr


def test_bench_lists_and_runs_a_benchmark():
    listed = cli("bench", "--list", timeout=60)
    assert listed.returncode == 0 and "plan_gpt" in listed.stdout
    out = cli("bench", "stage_dp_kernels", "--cases", "24x16", "--microbatches", "8", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert rows, out.stdout


# ------------------------------------------------------------------ explain and progress, in-process
def _toy_plan():
    from alpa_torch.capture import capture
    from alpa_torch.core.cluster import Cluster
    from alpa_torch.core.options import PlanOptions
    from alpa_torch.explain import alternatives, with_alternatives
    from alpa_torch.zoo import ZOO, make_optimizer, train_step
    from stage_dp.planner import make_plan_with_model

    model, batch = ZOO["mlp"]()
    graph = capture(train_step, model, make_optimizer("adamw", model), batch)
    plan, cost_model = make_plan_with_model(graph, Cluster.local(1, 2), PlanOptions(num_stages=2, num_microbatches=4))
    return with_alternatives(plan, alternatives(cost_model, plan))


def test_explain_parts_add_up_and_name_the_binding_constraint():
    import dataclasses

    from alpa_torch.explain import binding_constraint, explain, stage_breakdown

    plan = _toy_plan()
    for part in stage_breakdown(plan):
        total = part["compute_s"] + part["comm_s"] + part["bubble_s"]
        assert total == pytest.approx(plan.predicted_step_s, rel=1e-9) and part["bubble_s"] >= -1e-12
    assert binding_constraint(plan)[0] == "time"  # tiny MLP, 11 GiB per device
    faster = {"label": "no memory limit, B=1", "summary": "B=1 L0-1@1x2/2x1", "num_microbatches": 1,
              "num_stages": 1, "predicted_step_s": plan.predicted_step_s / 2, "compute_s": 0.0,
              "communication_s": 0.0, "bubble_s": 0.0, "peak_memory_bytes": 2 * plan.memory_budget_bytes,
              "fits": False, "memory_unlimited": True}
    tight = dataclasses.replace(plan, options={**plan.options, "alternatives": [faster]})
    kind, why = binding_constraint(tight)
    assert kind == "memory" and "over the" in why
    assert "Binding constraint: MEMORY" in explain(tight)
    # a runner-up on a lean column the search left unsolved is shown as the lower bound it is
    bound = {**faster, "label": "1 stage(s) forced, B=1", "summary": "B=1 L0-1@1x2/1x2[lean]",
             "num_stages": 1, "peak_memory_bytes": plan.memory_budget_bytes / 2, "fits": True,
             "memory_unlimited": False, "lower_bound": True}
    text = explain(dataclasses.replace(plan, options={**plan.options, "alternatives": [bound]}))
    row = next(line for line in text.splitlines() if "1 stage(s) forced" in line)
    assert row.split()[1].startswith(">=") and "yes?" in row and ">=: a lower bound" in text
    assert ">=" not in explain(tight)


def test_plan_progress_counts_ilps_and_renders_only_when_enabled():
    from alpa_torch.progress import PlanProgress, TrainProgress

    stream = io.StringIO()
    bar = PlanProgress(enabled=True, stream=stream)
    bar("4 layers (2 distinct), 3 meshes, B in [1, 2, 4]")
    assert bar.expected_ilps == 6 and bar.microbatch_candidates == [1, 2, 4]
    for n in range(1, 7):
        bar(f"ILP {n}: layer 0 (10 ops) on mesh (2, 1) of submesh (1, 2), fast")
    assert bar.ilps_done()
    bar("ILP 7: layer 1 (10 ops) on mesh (2, 1) of submesh (1, 2), lean")  # lean variants grow the total
    assert bar.expected_ilps == 7
    bar("planned in 1.0 s: B=4 L0-3@1x2/2x1")
    bar.close()
    assert "ILPs" in stream.getvalue() and bar.summary == "B=4 L0-3@1x2/2x1"
    silent = io.StringIO()
    with PlanProgress(enabled=None, stream=silent) as off:  # StringIO is not a terminal
        off("4 layers (2 distinct), 3 meshes, B in [1]")
    assert silent.getvalue() == "" and off.expected_ilps == 6
    train_stream = io.StringIO()
    with TrainProgress(2, batch_size=8, enabled=True, stream=train_stream) as tbar:
        tbar.update(0, 2.5, 3.0)
        tbar.update(1, 2.4, 0.5)
    assert "16.0 samples/s" in train_stream.getvalue() and "loss 2.40000" in train_stream.getvalue()


def test_a_planner_failure_names_the_job_and_keeps_the_workers_trace(run_main, monkeypatch, tmp_path):
    """A bug inside a forked planner process: one line naming what was being planned and a log file
    with the worker's traceback (not a bare re-raise from the pool)."""
    import re

    from stage_dp.stage_costs import StageCostModel

    def broken(self, rep, mesh, *args):
        raise IndexError(f"boom in layer {rep}")

    monkeypatch.setattr(StageCostModel, "_solve", broken)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main("plan", "gpt", "--local", "1x4", "--quiet")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 1 and len(lines) == 1 and not out, err
    assert "internal error: PlannerError" in lines[0] and "sharding ILPs of layer(s)" in lines[0], lines[0]
    log = Path(re.search(r"the full trace is in (\S+);", lines[0])[1])
    trace = log.read_text()
    assert "planner worker traceback" in trace and "in broken" in trace and "boom in layer" in trace
