"""``alpa-torch``: plan, explain, train, profile and benchmark from the command line.

    alpa-torch plan gpt-1.3b --cluster 2x8 --device v100-16gb --out plan.json --png plan.png
    alpa-torch explain plan.json
    alpa-torch train --local 1x2 --steps 5 --check
    alpa-torch profile --local 1x2 --out cluster.json
    alpa-torch bench plan_gpt --quick

Owns argument parsing, turning a model name into (model, optimizer, batch,
train_step) (``load_workload``), a cluster option into a ``Cluster``
(``cluster_from_args``), and printing. Planning, explaining, drawing and progress
live in ``stage_dp.search`` / ``explain`` / ``viz`` / ``progress``.

Errors: bad arguments, and options the planner finds impossible (``PlanError``,
``ClusterSpecError``, ``BatchSplitError``), print one line ``alpa-torch CMD:
error: ...`` and exit 2; any other alpa-torch error while working (no plan fits
in memory, a worker died) prints one line and exits 1; no traceback unless
``--debug``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from .bench_command import bench_help, cmd_bench
from .core.schedule import DEFAULT_SCHEDULE, schedule_names
from .workloads import (  # noqa: F401 - re-exported for users of alpa_torch.cli
    GPT3_SIZES,
    HF_FAMILIES,
    MODEL_HELP,
    REPO_ROOT,
    ZOO_MODELS,
    UsageError,
    Workload,
    _model_kwargs,
    _zoo,
    load_workload,
)

log = logging.getLogger("alpa_torch.cli")


# ------------------------------------------------------------------ clusters
def _shape(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOSTSxDEVICES (e.g. 2x4)")
    return int(m[1]), int(m[2])


def _existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def cluster_from_args(args, default_local=(1, 2)):
    """``--cluster`` (simulated) / ``--cluster-json`` / ``--address`` (Ray) / ``--local`` (the default)."""
    from alpa_torch.core.cluster import _DEFAULT_LINKS, Cluster
    from runtime.discovery import cluster_from_ray

    simulated = getattr(args, "cluster", None)
    if simulated is None and any(getattr(args, k, None) for k in ("device", "intra", "inter")):
        raise UsageError("--device / --intra / --inter describe a simulated cluster: give --cluster HOSTSxDEVICES too")
    if simulated is not None:
        device = args.device or "a100-80gb"
        intra, inter = _DEFAULT_LINKS.get(device, ("pcie4", "ib-200g"))
        return Cluster.simulated(*simulated, device=device, intra=args.intra or intra, inter=args.inter or inter)
    if getattr(args, "cluster_json", None):
        path = args.cluster_json
        return Cluster.from_yaml(path) if path.endswith((".yaml", ".yml")) else Cluster.from_json(path)
    if getattr(args, "address", None):
        return cluster_from_ray(args.address)
    if getattr(args, "local", None) is None and os.environ.get("RAY_ADDRESS") and getattr(args, "use_ray", False):
        return cluster_from_ray()
    return Cluster.local(*(args.local or default_local))


# ------------------------------------------------------------------ argument parsing
class _Parser(argparse.ArgumentParser):
    """One-line errors (exit 2) instead of usage + error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bars and no log messages")
    g.add_argument("-v", "--verbose", action="store_true", help="log planner and runtime messages (INFO)")
    g.add_argument("--debug", action="store_true", help="show tracebacks of errors")


def _cluster_options(p: argparse.ArgumentParser, *, simulated: bool, ray: bool) -> None:
    from alpa_torch.core.cluster import DEVICE_SPECS, LINK_SPECS

    g = p.add_argument_group("cluster (one of; default --local 1x2)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--local", type=_shape, metavar="HxD", help="HxD virtual CPU devices on this machine (gloo)")
    x.add_argument("--cluster-json", type=_existing_file, metavar="FILE",
                   help="a cluster description (JSON or YAML, as written by `alpa-torch profile`)")
    if simulated:
        x.add_argument("--cluster", type=_shape, metavar="HxD",
                       help="a simulated cluster of H hosts x D devices (planning only)")
        g.add_argument("--device", choices=sorted(DEVICE_SPECS), metavar="NAME",
                       help=f"device of --cluster: {', '.join(sorted(DEVICE_SPECS))} (default a100-80gb)")
        g.add_argument("--intra", choices=sorted(LINK_SPECS), metavar="LINK",
                       help=f"link inside a host: {', '.join(sorted(LINK_SPECS))} (default: by device)")
        g.add_argument("--inter", choices=sorted(LINK_SPECS), metavar="LINK",
                       help="link between hosts, same names (default: by device)")
    if ray:
        x.add_argument("--address", metavar="RAY_ADDRESS",
                       help="a running Ray cluster; its nodes and devices become the cluster (else RAY_ADDRESS)")


def _model_options(p: argparse.ArgumentParser, *, required: bool, default: str | None = None) -> None:
    g = p.add_argument_group("model")
    if required:
        g.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    else:
        g.add_argument("model", metavar="MODEL", nargs="?", default=default, help=f"{MODEL_HELP} (default {default})")
    g.add_argument("--batch", type=_positive, metavar="N", help="batch size (default 8; 1024 for gpt-*)")
    g.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                   help="model dtype (default float32; float16 for gpt-*, as Alpa's benchmark)")
    g.add_argument("--optimizer", default="adamw",
                   help="a zoo optimizer kind (alpa_torch.zoo.OPTIMIZERS; 'muon' pairs Muon with AdamW)")
    g.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="mixed precision: bf16 / fp16 (loss scaling) compute, fp32 master weights (default fp32)")
    g.add_argument("--model-arg", action="append", metavar="KEY=VALUE",
                   help="keyword for the model builder, repeatable (e.g. n_layer=4)")


def _planner_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("planner (parallelize options)")
    g.add_argument("--microbatches", type=_positive, metavar="B", help="force B microbatches")
    g.add_argument("--stages", type=_positive, metavar="K", help="force K pipeline stages")
    g.add_argument("--layers", type=_positive, metavar="L", help="cluster the operators into L layers")
    g.add_argument("--no-pipeline", action="store_true", help="one stage on the whole cluster")
    g.add_argument("--no-sharding", action="store_true", help="data parallel and pipeline only")
    g.add_argument("--memory-gib", type=_positive_float, metavar="GIB", help="memory budget per device")
    g.add_argument("--schedule", default=DEFAULT_SCHEDULE, choices=schedule_names(), help="pipeline schedule")
    g.add_argument("--checkpointing", default="auto", type=_checkpointing, metavar="MODE",
                   help="activation checkpointing: auto (where a stage needs it; default), none, full, "
                        "or GIB (the memory per device the stages must fit in)")


def _checkpointing(text: str):
    if text in ("auto", "none", "full"):
        return text
    try:
        return _positive_float(text) * 2.0**30
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not auto, none, full or a number of GiB") from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def plan_options(args):
    """The planner flags as ``PlanOptions``."""
    from alpa_torch.core.options import PlanOptions

    return PlanOptions(num_microbatches=args.microbatches, num_stages=args.stages, num_layers=args.layers,
                       pipeline=not args.no_pipeline, sharding=not args.no_sharding, schedule=args.schedule,
                       memory_budget_bytes=args.memory_gib * 2.0**30 if args.memory_gib else None,
                       checkpointing=args.checkpointing)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="alpa-torch", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"alpa-torch {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("plan", help="find a plan and print it", description=cmd_plan.__doc__, formatter_class=fmt)
    _model_options(p, required=True)
    _cluster_options(p, simulated=True, ray=False)
    _planner_options(p)
    g = p.add_argument_group("files")
    g.add_argument("--out", metavar="PLAN.json", help="write the plan (with its runner-ups) as JSON")
    g.add_argument("--png", metavar="FILE.png", help="draw the cluster by stage and the predicted timeline")
    g.add_argument("--trace", metavar="FILE.json", help="write the predicted timeline as a Chrome/Perfetto trace")
    g.add_argument("--no-alternatives", action="store_true", help="skip the runner-up plans (explain needs them)")
    _common(p)
    p.set_defaults(func="plan")

    p = sub.add_parser("explain", help="why a plan: time, memory, binding constraint, runner-ups",
                       description=cmd_explain.__doc__, formatter_class=fmt)
    p.add_argument("plan_file", metavar="PLAN.json", type=_existing_file, help="a plan written by `plan --out`")
    p.add_argument("--top", type=_positive, default=8, metavar="N", help="runner-ups to show (default 8)")
    p.add_argument("--png", metavar="FILE.png", help="also draw the plan")
    p.add_argument("--trace", metavar="FILE.json", help="also write the predicted timeline as a Chrome trace")
    _model_options(p, required=False)
    _common(p)
    p.set_defaults(func="explain")

    p = sub.add_parser("train", help="train a model on a local or Ray cluster", description=cmd_train.__doc__,
                       formatter_class=fmt)
    _model_options(p, required=False, default="demo")
    _cluster_options(p, simulated=False, ray=True)
    _planner_options(p)
    p.add_argument("--steps", type=_positive, default=5, metavar="N", help="training steps (default 5)")
    p.add_argument("--plan", dest="plan_file", type=_existing_file, metavar="PLAN.json", help="run this plan")
    p.add_argument("--check", action="store_true", help="replay the steps eagerly on one device and compare")
    p.add_argument("--tolerance", type=_positive_float, default=1e-4, help="--check: largest loss difference")
    p.add_argument("--trace", metavar="FILE.json", help="write what every device did in the last step as a "
                   "Perfetto trace, and the predicted one beside it (FILE.predicted.json)")
    _common(p)
    p.set_defaults(func="train", use_ray=True)

    p = sub.add_parser("profile", help="measure a cluster and write its description", description=cmd_profile.__doc__,
                       formatter_class=fmt)
    _cluster_options(p, simulated=False, ray=True)
    p.add_argument("--out", required=True, metavar="CLUSTER.json", help="where to write the calibrated cluster")
    p.add_argument("--repeats", type=_positive, help="timed passes per measurement (default 7; 3 with --quick)")
    p.add_argument("--sizes", metavar="BYTES,...", help="collective message sizes, e.g. 4096,1048576,16777216")
    p.add_argument("--quick", action="store_true", help="3 sizes, 3 repeats, small matmuls (a smoke test)")
    _common(p)
    p.set_defaults(func="profile", use_ray=True)

    p = sub.add_parser("bench", help="run a benchmark script from bench/", description=bench_help(),
                       formatter_class=fmt)
    p.add_argument("name", metavar="NAME", nargs="?", help="benchmark (a bench/NAME.py script)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed on to the script")
    p.add_argument("--list", action="store_true", help="list the benchmarks")
    p.set_defaults(func="bench", quiet=False, verbose=False, debug=False)
    return parser


def _version() -> str:
    from . import __version__

    return __version__


# ------------------------------------------------------------------ commands
_DESCRIPTION = """alpa-torch: plan, explain, train, profile and benchmark Alpa-style parallel training.

examples:
  alpa-torch plan gpt-1.3b --cluster 2x8 --device v100-16gb --out plan.json --png plan.png
  alpa-torch explain plan.json
  alpa-torch plan hf-llama --local 2x2 --stages 2 --trace predicted.json
  alpa-torch train --local 1x2 --steps 5 --check
  alpa-torch profile --local 1x2 --out cluster.json && alpa-torch plan demo --cluster-json cluster.json
  alpa-torch bench plan_gpt --quick

`alpa-torch COMMAND --help` lists each command's options."""


def _note(args, text: str) -> None:
    """A remark on stderr (files written, phases), silent under --quiet."""
    if not args.quiet:
        print(text, file=sys.stderr, flush=True)


def _workload(args) -> Workload:
    return load_workload(args.model, batch_size=args.batch, dtype=args.dtype, optimizer=args.optimizer,
                         model_args=args.model_arg)


def cmd_plan(args) -> int:
    """Find a plan for MODEL on a cluster and print it as a table.

Captures MODEL's training step on fake tensors (gpt-39b plans on a laptop),
clusters its operators into layers, solves one sharding ILP per distinct layer
and logical mesh, runs Alpa's stage DP over layer ranges x submeshes x
microbatch counts and prints the plan (README: "Reading the plan printout").
--out saves it as JSON with the runner-up plans the DP compared (re-running the
DP with forced stage counts, every microbatch count and no memory limit: cheap,
no new ILPs), which `alpa-torch explain` reads. --png draws the cluster
coloured by stage and the predicted pipeline timeline; --trace writes that
timeline as a Chrome/Perfetto trace (open it in ui.perfetto.dev)."""
    from stage_dp.planner import make_plan_with_model

    from . import explain
    from .capture import capture
    from .progress import PlanProgress

    _check_png(args)
    cluster = cluster_from_args(args)
    work = _workload(args)
    with PlanProgress(enabled=False if args.quiet else None) as bar:
        bar.phase(f"capturing the step of {work.name}")
        graph = capture(work.train_step, work.model, work.optimizer, work.batch, precision=args.precision,
                        device_type=cluster.device_type)
        bar.phase(f"clustering {len(graph.nodes)} operators into layers")
        plan, model = make_plan_with_model(graph, cluster, plan_options(args), progress=bar)
        if not args.no_alternatives:
            bar.phase("runner-up plans (stage DP with forced options)")
            plan = explain.with_alternatives(plan, explain.alternatives(model, plan))
    print(plan.table(), flush=True)
    _write_outputs(args, plan)
    return 0


def _check_png(args) -> None:
    """--png needs matplotlib: say so before planning, not after."""
    if getattr(args, "png", None):
        from alpa_torch.core.errors import require_extra

        require_extra("matplotlib", "plot", "--png")


def _write_outputs(args, plan) -> None:
    from . import viz

    if getattr(args, "out", None):
        plan.to_json(args.out)
        _note(args, f"wrote {args.out}")
    if args.png:
        viz.plan_figure(plan, args.png)
        _note(args, f"wrote {args.png}")
    if getattr(args, "trace", None):
        viz.write_trace(viz.predicted_trace(plan), args.trace)
        _note(args, f"wrote {args.trace} (predicted timeline; open in ui.perfetto.dev)")


def cmd_explain(args) -> int:
    """Explain a saved plan: per-stage compute, communication and bubble, memory
headroom per device, the binding constraint (memory or time) and the runner-up
plans the stage DP compared, with their predicted step times.

Plans written by `alpa-torch plan --out` carry their runner-ups. For a plan
saved another way (ParallelPlan.to_json after parallelize), give the MODEL it
was made for (with the same --batch/--dtype/--optimizer/--model-arg) and the
runner-ups are computed again (this re-solves the ILPs: as long as planning)."""
    from alpa_torch.core.plan import ParallelPlan

    from . import explain

    _check_png(args)
    plan = ParallelPlan.from_json(args.plan_file)
    if args.model:
        plan = _replan_alternatives(args, plan)
    print(explain.explain(plan, top=args.top), flush=True)
    _write_outputs(args, plan)
    return 0


def _replan_alternatives(args, plan):
    from alpa_torch.core.cluster import Cluster
    from alpa_torch.core.options import PlanOptions
    from alpa_torch.core.plan import graph_fingerprint
    from stage_dp.planner import make_plan_with_model

    from . import explain
    from .capture import capture
    from .progress import PlanProgress

    work = _workload(args)
    graph = capture(work.train_step, work.model, work.optimizer, work.batch,
                    device_type=Cluster.from_dict(plan.cluster).device_type)
    if graph_fingerprint(graph) != plan.graph_fingerprint:
        raise UsageError(f"{args.model} (with these --batch/--dtype/--optimizer/--model-arg) is not the graph "
                         f"{args.plan_file} was made for (fingerprint {plan.graph_fingerprint})")
    o = plan.options
    forced_b = plan.num_microbatches if len(o.get("microbatch_candidates", [])) == 1 else None
    options = PlanOptions(num_microbatches=forced_b, num_layers=plan.num_layers, num_stages=o.get("num_stages"),
                          pipeline=o.get("pipeline", True), sharding=o.get("sharding", True),
                          memory_budget_bytes=plan.memory_budget_bytes, schedule=plan.schedule)
    with PlanProgress(enabled=False if args.quiet else None) as bar:
        _, model = make_plan_with_model(graph, Cluster.from_dict(plan.cluster), options, progress=bar)
    if dict(model.layers.layer_of) != plan.layer_of:
        log.warning("re-planning cut the layers differently from the saved plan: runner-ups are approximate")
    return explain.with_alternatives(plan, explain.alternatives(model, plan))


def cmd_train(args) -> int:
    """Train MODEL with parallelize on a cluster of local virtual CPU devices
(--local, default 1x2) or on a running Ray cluster (--address, or RAY_ADDRESS):
the demo of examples/train_gpt.py. Prints the loss of every step ("step N loss
X, S samples/s"; a progress bar on a terminal), then the plan. --check replays
the same steps eagerly on one device and fails (exit 1) if a loss differs by more
than --tolerance. --plan runs a saved plan instead of searching. --trace records
when each device ran each forward, backward, update and transfer of the last step
and writes it as a Perfetto trace, with the cost model's prediction beside it."""
    import copy
    import time

    from .api import parallelize
    from .progress import PlanProgress, TrainProgress, interactive, samples_per_s

    work = _workload(args)
    if any(p.is_meta for p in work.model.parameters()):
        raise UsageError(f"{args.model} is built on the meta device for planning only; train a zoo or HF model")
    cluster = cluster_from_args(args)
    # one deepcopy of both: the copied optimizer holds the copied parameters
    reference = copy.deepcopy((work.model, work.optimizer)) if args.check else None
    batch_of = work.batch_fn or (lambda i: work.batch)
    size = _batch_size(work.batch)
    plan_bar = PlanProgress(enabled=False if args.quiet else None)
    step = parallelize(work.train_step, cluster, plan=args.plan_file, progress=plan_bar,
                       precision=args.precision, options=plan_options(args), trace=bool(args.trace))
    losses, times = [], []
    lines = not args.quiet and not interactive()
    try:
        with TrainProgress(args.steps, size, enabled=False if args.quiet else None) as bar:
            for i in range(args.steps):
                t0 = time.perf_counter()
                losses.append(float(step(work.model, work.optimizer, batch_of(i))))
                times.append(time.perf_counter() - t0)
                plan_bar.close()
                bar.update(i, losses[-1], times[-1])
                if lines:
                    rate = (f"{times[-1]:.1f} s: capture, plan, start-up" if i == 0 else
                            f"{samples_per_s(size, times[-1]):.1f} samples/s")
                    print(f"step {i} loss {losses[-1]:.6f} ({rate})", flush=True)
        if not args.quiet:
            print(step.plan.table(), flush=True)
        if args.trace:
            _write_traces(args, step)
    finally:
        plan_bar.close()
        step.shutdown()
    steady = times[1:] or times
    print(f"{args.steps} steps in {sum(times):.1f} s; {size * len(steady) / sum(steady):.1f} samples/s after the "
          "first step (which captures, plans and starts the workers)", flush=True)
    if reference is None:
        return 0
    worst = max(abs(_as_float(work.train_step(*reference, batch_of(i))) - loss) for i, loss in enumerate(losses))
    print(f"max |loss - eager loss| = {worst:.3g} ({'ok' if worst <= args.tolerance else 'FAILED'}, "
          f"tolerance {args.tolerance:g})", flush=True)
    return 0 if worst <= args.tolerance else 1


def _write_traces(args, step) -> None:
    """--trace: the last step as measured, and as the cost model predicts it, side by side."""
    from . import viz

    step.measured_trace(args.trace)
    predicted = str(Path(args.trace).with_suffix(".predicted.json"))
    viz.write_trace(viz.predicted_trace(step.plan), predicted)
    _note(args, f"wrote {args.trace} (measured, last step) and {predicted} (predicted); open them in "
          "ui.perfetto.dev, or draw both with alpa_torch.viz.compare_traces")


def _as_float(value) -> float:
    return float(value.detach()) if hasattr(value, "detach") else float(value)


def _batch_size(batch) -> int:
    import torch
    import torch.utils._pytree as pytree

    leaves = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0]
    return int(leaves[0].shape[0]) if leaves else 1


def cmd_profile(args) -> int:
    """Measure a cluster and write its calibrated description.

Starts one worker per device (on a private local Ray for --local, or on the Ray
cluster at --address / RAY_ADDRESS), measures matmul FLOP/s, memory bandwidth
and the alpha/beta of every collective (runtime/profile.py), fits the cost
model to them and writes the cluster as JSON (YAML if --out ends in .yaml).
Plan with it: `alpa-torch plan MODEL --cluster-json CLUSTER.json`."""
    cluster = cluster_from_args(args)
    kwargs: dict[str, Any] = {"repeats": args.repeats or 7}
    if args.quick:
        kwargs.update(sizes_bytes=(4 << 10, 256 << 10, 8 << 20), repeats=args.repeats or 3, matmul_sizes=(128, 256))
    if args.sizes:
        kwargs["sizes_bytes"] = _sizes(args.sizes)
    _note(args, f"profiling {cluster.describe()}")
    from runtime.profile import profile_cluster

    profiled = profile_cluster(cluster, **kwargs)
    if args.out.endswith((".yaml", ".yml")):
        profiled.to_yaml(args.out)
    else:
        profiled.to_json(args.out)
    print(profiled.describe(), flush=True)
    _note(args, f"wrote {args.out}")
    return 0


def _sizes(text: str) -> tuple[int, ...]:
    units = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20}
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", part)
        if not m or m[2].lower() not in units:
            raise UsageError(f"--sizes {text!r}: {part!r} is not a byte count like 4096, 64KiB or 16MiB")
        out.append(int(m[1]) * units[m[2].lower()])
    if len(set(out)) < 2 or min(out) < 4:
        raise UsageError(f"--sizes {text!r}: give at least 2 distinct sizes of >= 4 bytes")
    return tuple(out)


_COMMANDS = {"plan": cmd_plan, "explain": cmd_explain, "train": cmd_train, "profile": cmd_profile,
             "bench": cmd_bench}


# ------------------------------------------------------------------ main
def _configure_logging(args) -> None:
    level = logging.ERROR if args.quiet else logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not args.verbose:  # the planner's per-operator notes; --verbose shows them
        logging.getLogger("intra_ilp.strategies").setLevel(max(level, logging.ERROR))
    for noisy in ("ray", "intra_ilp.ilp", "intra_ilp.reduce", "pyomo"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args)
    from alpa_torch.core.errors import AlpaTorchError, BatchSplitError, ClusterSpecError, PlanError, PlannerError

    try:
        return _COMMANDS[args.func](args)
    except UsageError as exc:
        print(f"alpa-torch {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (ClusterSpecError, PlanError, BatchSplitError) as exc:  # what the arguments asked for is impossible
        if args.debug:
            raise
        print(f"alpa-torch {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except PlannerError as exc:  # a failure of the planner itself: one line, the trace in a file
        if args.debug:
            raise
        return _internal_error(args, exc)
    except (AlpaTorchError, OSError) as exc:
        if args.debug:
            raise
        print(f"alpa-torch {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"alpa-torch {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug: one line for the user, the whole trace in a file
        if args.debug:
            raise
        return _internal_error(args, exc)


def _internal_error(args, exc: BaseException) -> int:
    """Print one line naming the failure and a log file holding the full traceback (exit 1)."""
    import tempfile
    import traceback

    trace = "".join(traceback.format_exception(exc))
    with tempfile.NamedTemporaryFile("w", prefix=f"alpa-torch-{args.command}-", suffix=".log", delete=False) as f:
        f.write(trace)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    print(f"alpa-torch {args.command}: internal error: {type(exc).__name__}: {first} (the full trace is in "
          f"{f.name}; --debug prints it; please report it)", file=sys.stderr)
    return 1


def entry() -> None:
    """The ``alpa-torch`` command: ``main()``, its exit handlers (Ray's shutdown among them)
    and output flushed, then ``os._exit``, skipping the interpreter's teardown (freeing a
    planned graph took 1.6 s after LLaMA-3-8B's plan was printed); the normal exit if
    another thread still runs."""
    import atexit
    import threading

    code = main()
    if threading.active_count() == 1:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
