"""Plan published Hugging Face architectures on simulated GPU clusters; one JSON line per (model, cluster).

Models (``alpa_torch/zoo_hf.py``, configs as published, built on the ``meta`` device,
nothing downloaded): LLaMA-3-8B, LLaMA-3-70B, Mistral-7B, Mixtral-8x7B, Qwen2-7B,
GPT-2 XL, BERT-large (masked LM), T5-large, ViT-L/16, each at the sequence length and
global batch ``PublishedModel.setting`` gives (e.g. LLaMA-3-8B: 4096 tokens x 128
sequences). Each trains with AdamW (``zoo.make_optimizer``) and ``precision='bf16'``
(fp32 master weights and optimizer state, bf16 compute under autocast), with the step
Hugging Face documents: ``loss = model(**batch).loss`` with ``labels`` in the batch.
Each model is captured once and its graph planned on every cluster.

Clusters (``Cluster.simulated`` with the links ``alpa-torch plan --cluster`` picks,
``cli.cluster_from_args``): 8x8 A100-80GB, 8x8 H100-80GB, 16x8 H100-80GB, and 8x8
V100-16GB for the models whose model states (16 bytes per parameter: fp32 weights,
gradients, AdamW's two moments) take at most half of its 1 TiB (LLaMA-3-70B and
Mixtral do not: their lines say ``"status": "skipped"``). V100 has no bf16 tensor cores:
the cost model prices bf16 at its fp32 peak (``DEVICE_SPECS``), and MFU uses that peak.

Dropout: as published (0.1 in GPT-2 XL, BERT-large and T5-large) unless ``--no-dropout``.
The planner has no sharding rule for the ``aten.bernoulli.p`` that dropout captures as
(torch 2.13's DTensor registers ``bernoulli.default`` and ``bernoulli_.float`` only), so
every dropout mask is computed whole on every device, [batch, heads, seq, seq] for
attention dropout: measured on a 2-layer BERT-large at 256 x 512 on 8x8 H100, one stage,
0.060 s and 11.4 GiB per device with dropout, 0.022 s and 1.4 GiB without.

What the captured graphs are (they are priced as captured): HF's default sdpa attention is
one fused operator (``alpa_torch/core/attention_op.py``: priced by its own FLOPs at the compute
dtype's peak, saving its output and log-sum-exp, never the [batch, heads, seq, seq] scores),
except with attention dropout (BERT-large and GPT-2 XL as published), which capture still
takes in the math form (``alpa_torch.tracing.FusedAttention``: the fused kernels' own dropout
is not seeded by ``runtime/rng.py`` yet); T5's attention is written by hand and stays so. Mixtral's
experts (transformers' grouped_mm, which autocast leaves in fp32) are decomposed into dense
masked matmuls (``alpa_torch/grouped_mm.py``): every expert on every routed token, 8x the
top-2 expert FLOPs, at the fp32 rate, so its predicted step is slower than grouped kernels
would be.

Keys: model, cluster, device, devices, search ('full': the stage DP over pipelines;
'one_stage': ``pipeline=False``), seq_len, global_batch, dropout, params, graph_tflops (FLOPs of
the captured step: forward, backward, update), capture_s, plan_s (wall), plan_cpu_s
(this process and its finished children: the planner's forked ILP workers,
``stage_dp/fork_pool.py``), status, and for a plan: predicted_step_s (Alpa eq. 2) =
compute_s + communication_s + bubble_s (``ParallelPlan``), peak_memory_gib
(simulated, ``stage_dp/memory_sim.py``) against device_memory_gib, stages,
num_microbatches, num_layers, recomputed_layers, meshes (per stage: layers, submesh,
logical mesh, ILP variant, recomputed layers), plan (summary), mfu = graph FLOPs /
(devices x bf16 peak x predicted step). ``"status": "infeasible"`` carries required_bytes
(``InfeasibleMemoryError``); ``"error"`` any other failure, by name.

Usage: python bench/plan_zoo.py [--models llama3-8b,gpt2-xl] [--clusters h100-8x8,a100-8x8]
                                [--search full,one_stage] [--quick] [--no-dropout] [--out FILE] [-v]
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: never the network

from _common import emit, select

from alpa_torch.capture import capture
from alpa_torch.cli import cluster_from_args
from alpa_torch.core.errors import AlpaTorchError, InfeasibleMemoryError
from alpa_torch.zoo_hf import PUBLISHED, hf_published
from stage_dp.search import plan

log = logging.getLogger("plan_zoo")
CLUSTERS = {"a100-8x8": (8, 8, "a100-80gb"), "h100-8x8": (8, 8, "h100-80gb"), "h100-16x8": (16, 8, "h100-80gb"),
            "v100-8x8": (8, 8, "v100-16gb")}
SEARCHES = {"full": {}, "one_stage": {"pipeline": False}}
QUICK_MODELS, QUICK_CLUSTER = ("vit-l16", "bert-large"), "h100-8x8"
"""--quick: the two smallest models (0.30 and 0.34 B parameters) on one cluster."""
STATE_BYTES_PER_PARAM = 16
"""fp32 master weight, gradient, AdamW exp_avg and exp_avg_sq."""
V100_STATE_FRACTION = 0.5
"""A model is planned on V100s when its model states take at most this share of their memory."""
_GiB = 2.0**30


def cluster(name: str):
    """The simulated cluster ``name`` of ``CLUSTERS``, built as ``alpa-torch plan --cluster HxD --device D``."""
    hosts, per_host, device = CLUSTERS[name]
    return cluster_from_args(argparse.Namespace(cluster=(hosts, per_host), device=device, intra=None, inter=None))


def cpu_s() -> float:
    """CPU seconds of this process and of its finished children (the planner's workers)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def captured(name: str, dropout: bool) -> tuple[object, dict]:
    """The bf16 graph of ``name``'s training step and the facts of the case (seq, batch, params)."""
    m = PUBLISHED[name]
    model, optimizer, batch, step = hf_published(name, dropout=dropout)
    facts = {"seq_len": m.seq_len, "global_batch": m.global_batch, "dropout": dropout,
             "params": sum(p.numel() for p in model.parameters())}
    t0 = time.perf_counter()
    graph = capture(step, model, optimizer, batch, precision="bf16")
    facts.update(capture_s=round(time.perf_counter() - t0, 2), graph_tflops=round(graph.total_flops() / 1e12, 1))
    return graph, facts


def skip_reason(cluster_name: str, params: int) -> str | None:
    """Why (model, cluster) is not planned, or None (module docstring: V100)."""
    cl = cluster(cluster_name)
    states = STATE_BYTES_PER_PARAM * params
    if cl.device.name.startswith("v100") and states > V100_STATE_FRACTION * cl.num_devices * cl.device.memory_bytes:
        return (f"model states {states / _GiB:.0f} GiB exceed {V100_STATE_FRACTION:.0%} of the cluster's "
                f"{cl.num_devices * cl.device.memory_bytes / _GiB:.0f} GiB")
    return None


def describe_plan(p, graph, cl) -> dict:
    """The plan's shape and predictions (module docstring, keys)."""
    peak = cl.device.flops_per_s("bfloat16")
    meshes = [{"layers": [s.layer_start, s.layer_end], "submesh": list(s.submesh), "logical_mesh": list(s.logical_mesh),
               "variant": s.variant, "recomputed": len(s.recompute_layers)} for s in p.stages]
    return {"predicted_step_s": round(p.predicted_step_s, 4), "compute_s": round(p.compute_s, 4),
            "communication_s": round(p.communication_s, 4), "bubble_s": round(p.bubble_s, 4),
            "peak_memory_gib": round(p.peak_memory_bytes / _GiB, 2),
            "device_memory_gib": round(cl.device.memory_bytes / _GiB, 1), "stages": len(p.stages),
            "num_microbatches": p.num_microbatches, "num_layers": p.num_layers,
            "recomputed_layers": len(p.recompute_layers), "meshes": meshes, "plan": p.summary(),
            "mfu": round(graph.total_flops() / (cl.num_devices * peak * p.predicted_step_s), 4)}


def run_case(graph, facts: dict, model: str, cluster_name: str, search: str, progress) -> dict:
    """Plan ``graph`` on ``cluster_name``: one JSON-able dict."""
    cl = cluster(cluster_name)
    out = {"model": model, "cluster": cluster_name, "device": cl.device.name, "devices": cl.num_devices,
           "search": search, **facts}
    reason = skip_reason(cluster_name, facts["params"])
    if reason:
        return {**out, "status": "skipped", "reason": reason}
    t0, c0 = time.perf_counter(), cpu_s()
    try:
        p = plan(graph, cl, progress=progress, **SEARCHES[search])
        out.update(status="ok", **describe_plan(p, graph, cl))
    except InfeasibleMemoryError as exc:
        out.update(status="infeasible", required_bytes=exc.required_bytes,
                   required_gib=round(exc.required_bytes / _GiB, 2), error=str(exc))
    except AlpaTorchError as exc:
        out.update(status="error", error=f"{type(exc).__name__}: {exc}")
    out.update(plan_s=round(time.perf_counter() - t0, 2), plan_cpu_s=round(cpu_s() - c0, 2))
    return out


def run_model(name: str, clusters: list[str], searches: list[str], args, progress) -> None:
    """Capture ``name`` once; one line per (cluster, search). A capture failure gives each an error line."""
    log.info("capturing %s", name)
    try:
        graph, facts = captured(name, not args.no_dropout)
    except AlpaTorchError as exc:
        for c in clusters:
            for s in searches:
                emit({"model": name, "cluster": c, "search": s, "status": "error",
                      "error": f"capture: {type(exc).__name__}: {exc}"}, args.out)
        return
    log.info("%s captured in %.1f s: %s", name, facts["capture_s"], graph.summary())
    for c in clusters:
        for s in searches:
            emit(run_case(graph, facts, name, c, s, progress), args.out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(PUBLISHED), help=f"comma list of {list(PUBLISHED)}")
    ap.add_argument("--clusters", default=",".join(CLUSTERS), help=f"comma list of {list(CLUSTERS)}")
    ap.add_argument("--search", default="full", help=f"comma list of {list(SEARCHES)} (default full)")
    ap.add_argument("--quick", action="store_true",
                    help=f"{' and '.join(QUICK_MODELS)} on {QUICK_CLUSTER} only (the two smallest models)")
    ap.add_argument("--no-dropout", action="store_true",
                    help="set the published dropout probabilities (GPT-2 XL, BERT, T5: 0.1) to 0")
    ap.add_argument("--out", metavar="FILE", help="also append the JSON lines to FILE")
    ap.add_argument("--verbose", "-v", action="store_true", help="planner progress on stderr")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    models = select(ap, args.models, PUBLISHED, "model")
    clusters = select(ap, args.clusters, CLUSTERS, "cluster")
    searches = select(ap, args.search, SEARCHES, "search")
    if args.quick:
        models, clusters = list(QUICK_MODELS), [QUICK_CLUSTER]
    t_start = time.perf_counter()

    def progress(msg):
        if args.verbose:
            print(f"[{time.perf_counter() - t_start:8.1f} s] {msg}", file=sys.stderr, flush=True)

    for name in models:
        run_model(name, clusters, searches, args, progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
