"""One device: ``parallelize`` against eager PyTorch and ``torch.compile`` on the same training step.

Usage (from the repository root; about 20 minutes with compiling, ``--systems eager,parallelize``
about 5)::

    python bench/one_device.py                                  # every workload, system and T
    python bench/one_device.py --workloads gpt --lengths 4096 --systems eager,parallelize
    python bench/one_device.py --device cuda --dtype bfloat16 --workloads llama1b --lengths 2048,8192  # one GPU

Each (workload, sequence length, system) trains in a process of its own, started fresh
(``--worker``), so no run inherits another's memory or compiled code:

- workloads: ``gpt``, the zoo's GPT with ``scaled_dot_product_attention`` (2 layers, width
  128, 4 heads, vocabulary 1024), and ``llama``, a Hugging Face ``LlamaForCausalLM`` (2
  layers, hidden 128, 4 heads, 2 key/value heads, MLP 256, vocabulary 1024, its default
  attention), both at batch 2, AdamW, float32; ``llama1b``, the published LLaMA-3.2-1B
  configuration (1.24 B parameters, tied embeddings), for a GPU (``--device cuda --dtype
  bfloat16``: the model is built on the device in that dtype, ``parallelize``'s cluster is that
  GPU's built-in spec, one Ray worker holding it);
- systems: ``eager`` (the step as written), ``compile`` (``torch.compile(train_step)``, as
  PyTorch's docs compile a training step) and ``parallelize`` (``parallelize(train_step,
  Cluster.local(1, 1))`` with default options: one worker process, its plan found by itself);
  ``parallelize_compiled``, a diagnostic named in ``--systems``, is ``parallelize`` with
  ``compile=True`` (the worker's program compiled by Inductor, ``runtime/regions.py``);
  every process uses as many torch threads as the ``parallelize`` worker gets (one device's
  share of this machine's cores).

One JSON line per run: the median of ``--steps`` timed steps after ``--warmup`` untimed
ones (the driver's wall clock per call; for ``parallelize``, its call returns when the loss
is ready, and the next call waits for the rest, so the median is the step), the first call's
time (capturing, planning or compiling included) and the peak resident memory of the process
that trains (``VmHWM``; for ``parallelize``, its worker's), and on CUDA that process's
``torch.cuda.max_memory_allocated``. A summary line per workload and T
gives ``parallelize / eager`` and ``parallelize / compile`` for step and peak.

Targets (issue: attention stays one fused operator): at T = 4096, ``parallelize``'s peak at
most 1.15x eager's and its step at most 1.05x eager's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _common import emit, max_rss_mb
from _plans import machine_info

WORKLOADS = ("gpt", "llama")  # the default run; ``llama1b`` is named for a GPU
SYSTEMS = ("eager", "compile", "parallelize")
BATCH, VOCAB = 2, 1024


def _build(workload: str, length: int, device: str, dtype):
    import torch

    torch.manual_seed(0)
    with torch.device(device):
        model, batch, step_fn = _build_on(workload, length)
    return model.to(dtype), batch, step_fn


def _build_on(workload: str, length: int):
    """The model (built on the current default device), its batch and its step."""
    import torch

    if workload == "gpt":
        from alpa_torch.zoo import GPT, GPTConfig, train_step

        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=length, n_layer=2, n_head=4, n_embd=128,
                              attention="sdpa"))
        tokens = torch.randint(0, VOCAB, (BATCH, length + 1))
        return model.train(), (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), train_step
    from transformers import LlamaConfig, LlamaForCausalLM

    from alpa_torch.zoo_hf import hf_train_step

    if workload == "llama1b":  # LLaMA-3.2-1B as published
        cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=max(length, 8192),
                          rope_theta=500000.0, tie_word_embeddings=True)
    else:
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=length)
    model = LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (BATCH, length))
    return model, {"input_ids": ids, "labels": ids}, hf_train_step


def worker(system: str, workload: str, length: int, steps: int, warmup: int, threads: int, device: str,
           dtype: str) -> dict:
    """One run in this process (``--worker``): the JSON line of the module docstring."""
    import torch

    torch.set_num_threads(threads)
    model, batch, step_fn = _build(workload, length, device, getattr(torch, dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peak = _peaks
    if system == "compile":
        step_fn = torch.compile(step_fn)
    elif system.startswith("parallelize"):
        from alpa_torch import parallelize

        options = {"compile": True} if system == "parallelize_compiled" else {}  # the default: none
        step_fn = parallelize(step_fn, _cluster(device), **options)

        def peak():  # the worker's peaks: the process that trains
            return step_fn.group.call_all(_worker_peaks)[0]
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        float(step_fn(model, optimizer, batch))
        times.append(time.perf_counter() - t0)
    row = {"bench": "one_device", "system": system, "workload": workload, "seq_len": length, "batch": BATCH,
           "device": device, "dtype": dtype, "threads": threads, "first_call_s": round(times[0], 2),
           "step_median_ms": round(1e3 * statistics.median(times[warmup:]), 1), **peak()}
    if system.startswith("parallelize"):
        row["plan"] = step_fn.plan.table().splitlines()[-3] if step_fn.plan else None
        row["compiled"] = step_fn.compiled  # ``compile=None``: what measured plan selection kept
        row["tuning"] = [{"label": t["label"], "measured_ms": None if t["measured_s"] is None else
                          round(1e3 * t["measured_s"], 1), "kept": t["kept"]} for t in step_fn.tuning]
        if system == "parallelize_compiled":
            row["regions"] = step_fn.group.call_all(_regions)[0]
        step_fn.shutdown()
    return row


def _cluster(device: str):
    """``Cluster.local(1, 1)`` on CPU; on CUDA, one device of the GPU's built-in spec on a local Ray
    that lends the worker the GPU."""
    from alpa_torch import Cluster

    if device == "cpu":
        return Cluster.local(1, 1)
    import ray
    import torch

    from runtime.discovery import builtin_device_for_cuda

    ray.init(address="local", num_gpus=1, include_dashboard=False)
    return Cluster.simulated(1, 1, builtin_device_for_cuda(torch.cuda.get_device_name(0)) or "a100-80gb")


def _peaks() -> dict:
    """This process's peak resident memory and, where CUDA is in use, its peak CUDA allocation."""
    import torch

    out = {"peak_mb": round(max_rss_mb(), 1)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def _worker_peaks(state) -> dict:
    return _peaks()


def _regions(state) -> list[dict]:
    """The worker's compiled regions: steps, seconds spent compiling or loading, whether loaded from
    the cache beside the plan (a second run of the script: nothing compiled) and why any failed."""
    fast = state["runner"].program.fast
    return [{"steps": len(r.steps), "compile_s": round(r.compile_s, 2), "loaded": r.loaded, "failed": r.failed}
            for r in fast.regions]


def _threads() -> int:
    """The torch threads a ``parallelize`` worker of ``Cluster.local(1, 1)`` gets on this machine."""
    from alpa_torch import Cluster

    return Cluster.local(1, 1).threads_per_device


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--lengths", default="512,2048,4096")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--timeout", type=float, default=None, help="seconds each run may take (default: no limit)")
    ap.add_argument("--out", metavar="FILE", help="also append the JSON lines to FILE")
    ap.add_argument("--worker", nargs=4, metavar=("SYSTEM", "WORKLOAD", "T", "THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        system, workload, length, threads = args.worker
        print(json.dumps(worker(system, workload, int(length), args.steps, args.warmup, int(threads), args.device,
                                args.dtype)), flush=True)
        return 0
    threads = _threads() if args.device == "cpu" else os.cpu_count()
    info = {**machine_info(), "argv": list(sys.argv[1:] if argv is None else argv)}
    for workload in args.workloads.split(","):
        for length in map(int, args.lengths.split(",")):
            rows = {}
            for system in args.systems.split(","):
                row = _run_worker(args, system, workload, length, threads)
                rows[system] = row = {**row, **info}
                emit(row, args.out)
            emit(_summary(workload, length, rows, info), args.out)
    return 0


def _run_worker(args, system: str, workload: str, length: int, threads: int) -> dict:
    """One (system, workload, T) in a fresh process: its JSON line, or the error it ended with."""
    cmd = [sys.executable, __file__, "--worker", system, workload, str(length), str(threads), "--steps",
           str(args.steps), "--warmup", str(args.warmup), "--device", args.device, "--dtype", args.dtype]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    except subprocess.TimeoutExpired as e:
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {"bench": "one_device", "system": system, "workload": workload, "seq_len": length,
                "error": f"timed out after {args.timeout} s; " + err[-1200:]}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    return {"bench": "one_device", "system": system, "workload": workload, "seq_len": length,
            "error": done.stderr[-1500:]}


def _summary(workload: str, length: int, rows: dict, info: dict) -> dict:
    out = {"bench": "one_device", "summary": True, "workload": workload, "seq_len": length, **info}
    for system, prefix in (("parallelize", ""), ("parallelize_compiled", "compiled_")):
        par = rows.get(system, {})
        for peer in ("eager", "compile"):
            other = rows.get(peer, {})
            if "step_median_ms" in par and "step_median_ms" in other:
                out[f"{prefix}step_over_{peer}"] = round(par["step_median_ms"] / other["step_median_ms"], 3)
                out[f"{prefix}peak_over_{peer}"] = round(par["peak_mb"] / other["peak_mb"], 3)
                if "cuda_peak_mb" in par and "cuda_peak_mb" in other:
                    out[f"{prefix}cuda_peak_over_{peer}"] = round(par["cuda_peak_mb"] / other["cuda_peak_mb"], 3)
    if "cuda_peak_over_eager" in out and "step_over_compile" in out:  # the compiled-programs issue, on a GPU
        out["target"] = "step <= 1.0x compile, CUDA peak <= eager's"
        out["met"] = out["step_over_compile"] <= 1.0 and out["cuda_peak_over_eager"] <= 1.0
    elif length == 4096 and "step_over_eager" in out:
        out["target"] = "peak <= 1.15x eager, step <= 1.05x eager"
        out["met"] = out["peak_over_eager"] <= 1.15 and out["step_over_eager"] <= 1.05
    return out


if __name__ == "__main__":
    sys.exit(main())
