"""Benchmark the stage DP on GPT-shaped synthetic cost tensors.

Prints one JSON line per case: case, layers, devices, microbatches, dp_s,
num_tmax_evaluated, total_s, stages; the first line also has compile_s (numba
compile or cache load, excluded from dp_s) and a warm-up case.

Cost model (synthetic, after Alpa's GPT runs, A100-40GB-like devices, 8 per host):
one transformer layer of hidden h, microbatch b = 8, sequence 1024 costs
4 × 24 b s h² (1 + s / 6h) FLOPs (forward, backward, recompute) at 150 TFLOP/s;
the first and last layer (embedding, LM head) cost 1.5×. A stage of layers
l..i on k devices with config c takes

    t = sum of layer times / (k · eff_c(k)) + 2 ms,  eff_c(k) = 1 / (1 + a_c log2 k + p_c [k > 8])

times a ±2 % deterministic noise (profiling jitter). Configs: c = 0 data parallel
(weights replicated), 1 tensor parallel inside a host (weights / min(k, 8)),
2 fully sharded (weights / k); 1-device submeshes only have c = 0.
Memory: weights + Adam state 16 B/param, 12 h² params per layer; activations
kept per in-flight microbatch 2 b s h bytes per layer (rematerialised), all / k;
max_n_succ = floor((mem - weights) / activations) - 1, -1 when < 0.

Usage: python bench/stage_dp_kernels.py [--no-numba] [--cases 24x16,96x64]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from stage_dp import solve_stage_dp

HIDDEN_BY_LAYERS = {24: 2048, 48: 4096, 96: 4096}
SEQ, MICROBATCH, DEVICE_FLOPS, DEVICE_MEM_BYTES, HOST_DEVICES = 1024, 8, 150e12, 40e9, 8
CONFIGS = (  # (a_c, p_c, weight sharding: k -> divisor)
    (0.02, 0.10, lambda k: 1),
    (0.05, 0.05, lambda k: min(k, HOST_DEVICES)),
    (0.08, 0.25, lambda k: k),
)


def submesh_sizes(num_hosts: int) -> np.ndarray:
    """Alpa's submesh shapes (1, 2^j) for 2^j <= 8 and (n, 8) for n <= num_hosts."""
    small = [2 ** j for j in range(4) if 2 ** j < HOST_DEVICES]
    return np.array(small + [n * HOST_DEVICES for n in range(1, num_hosts + 1)], np.int64)


def gpt_costs(num_layers: int, num_hosts: int, seed: int = 0):
    """(stage_cost_s [L, L, S, 3], max_n_succ [L, L, S, 3], submesh_sizes [S])."""
    h = HIDDEN_BY_LAYERS.get(num_layers, 4096)
    layer_s = 4 * 24 * MICROBATCH * SEQ * h * h * (1 + SEQ / (6 * h)) / DEVICE_FLOPS
    weight_bytes = np.full(num_layers, 16.0 * 12 * h * h)
    act_bytes = np.full(num_layers, 2.0 * MICROBATCH * SEQ * h)
    layer_time = np.full(num_layers, layer_s)
    layer_time[[0, -1]] *= 1.5
    weight_bytes[[0, -1]] *= 1.5
    def span(x):
        return (np.r_[0.0, np.cumsum(x)][None, 1:] - np.r_[0.0, np.cumsum(x)][:-1, None])
    t_sum, w_sum, a_sum = span(layer_time), span(weight_bytes), span(act_bytes)  # [L, L]
    sizes = submesh_sizes(num_hosts)
    rng = np.random.default_rng(seed)
    shape = (num_layers, num_layers, sizes.size, len(CONFIGS))
    cost = np.full(shape, np.inf)
    mns = np.full(shape, -1, np.int64)
    upper = np.triu(np.ones((num_layers, num_layers), bool))
    for s, k in enumerate(sizes):
        for c, (a_c, p_c, shard) in enumerate(CONFIGS):
            if k == 1 and c > 0:
                continue
            eff = 1.0 / (1.0 + a_c * np.log2(k) + p_c * (k > HOST_DEVICES))
            noise = 1.0 + 0.02 * (2 * rng.random((num_layers, num_layers)) - 1)
            t = (t_sum / (k * eff) + 2e-3) * noise
            free = DEVICE_MEM_BYTES - w_sum / shard(k)
            with np.errstate(divide="ignore", invalid="ignore"):  # a_sum = 0 below the diagonal
                n_succ = np.floor(free / (a_sum / k)) - 1
            cost[:, :, s, c] = np.where(upper, t, np.inf)
            mns[:, :, s, c] = np.where(upper, np.clip(n_succ, -1, num_layers), -1)
    return cost, mns, sizes


def run_case(num_layers: int, num_hosts: int, microbatches: int, use_numba: bool) -> dict:
    cost, mns, sizes = gpt_costs(num_layers, num_hosts)
    devices = num_hosts * HOST_DEVICES
    start = time.perf_counter()
    res = solve_stage_dp(cost, mns, sizes, devices, microbatches, use_numba=use_numba)
    dp_s = time.perf_counter() - start
    return {"case": f"gpt_L{num_layers}_{num_hosts}x{HOST_DEVICES}", "layers": num_layers,
            "devices": devices, "microbatches": microbatches, "dp_s": round(dp_s, 4),
            "num_tmax_evaluated": res.num_tmax_evaluated, "total_s": res.total_s,
            "t_max_s": res.t_max_s, "num_stages": len(res.stages),
            "stages": [list(st) for st in res.stages]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-numba", action="store_true", help="run the pure-Python twins")
    parser.add_argument("--cases", default="24x16,48x16,96x16,24x64,48x64,96x64",
                        help="comma-separated LAYERSxDEVICES (devices 16 = 2x8, 64 = 8x8)")
    parser.add_argument("--microbatches", type=int, default=128)
    args = parser.parse_args()
    use_numba = not args.no_numba
    start = time.perf_counter()
    run_case(4, 1, 4, use_numba)  # warm-up: numba compile or cache load
    compile_s = time.perf_counter() - start
    for n, case in enumerate(args.cases.split(",")):
        layers, devices = (int(x) for x in case.split("x"))
        row = run_case(layers, devices // HOST_DEVICES, args.microbatches, use_numba)
        if n == 0:
            row = {"compile_s": round(compile_s, 3), **row}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
