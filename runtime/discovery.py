"""A running Ray cluster as a ``Cluster``: ``cluster_from_ray``.

Owns: which Ray nodes are hosts (GPU nodes, else CPU nodes), how many devices
each contributes, and which built-in device spec Ray's accelerator type maps
to. The ``Cluster`` value type knows nothing of Ray; this module builds one
(``Cluster.discovered``) from what Ray reports.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

from alpa_torch.core.cluster import (
    _MAX_CPU_DEVICES_PER_HOST,
    DEVICE_SPECS,
    Cluster,
    DeviceSpec,
    LinkSpec,
    _build,
    _cpu_device,
    _host_memory_bytes,
)
from alpa_torch.core.errors import ClusterSpecError

logger = logging.getLogger(__name__)

# Ray accelerator_type -> built-in device.
_RAY_ACCELERATORS = {"V100": "v100-16gb", "A100": "a100-40gb", "A100-40G": "a100-40gb",
                     "A100-80G": "a100-80gb", "H100": "h100-80gb", "B200": "b200"}

_CUDA_NAMES = (("h100", "h100-80gb"), ("h200", "h100-80gb"), ("b200", "b200"), ("v100", "v100-16gb"))
"""Substring of ``torch.cuda.get_device_name`` (lower case) -> built-in device; A100 by its memory."""


def builtin_device_for_cuda(name: str) -> str | None:
    """The built-in device spec for a CUDA device named ``name`` (as ``torch.cuda.get_device_name``
    gives it, e.g. 'NVIDIA H100 80GB HBM3'), or None when no built-in matches. An H200 is priced as
    an H100 (the same compute; its larger memory is left unused by the plan)."""
    lower = name.lower()
    if "a100" in lower:
        return "a100-80gb" if "80g" in lower else "a100-40gb"
    return next((spec for key, spec in _CUDA_NAMES if key in lower), None)


class _RayLayout(NamedTuple):
    device: DeviceSpec
    num_hosts: int
    devices_per_host: int
    threads_per_device: int
    backend: str


def _node_name(node: Mapping[str, Any]) -> str:
    return f"{node.get('NodeManagerAddress', '?')} ({str(node.get('NodeID', '?'))[:8]})"


def read_ray_layout(address: str | None, device: str | DeviceSpec | None) -> _RayLayout:
    import ray  # heavy; only needed here

    if not ray.is_initialized():
        logger.info("connecting to Ray at %s", address or "Ray's default address")
        ray.init(address=address)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    gpu_nodes = [n for n in nodes if int(n.get("Resources", {}).get("GPU", 0)) >= 1]
    if gpu_nodes:
        if len(gpu_nodes) < len(nodes):
            logger.info("skipping %d Ray node(s) without GPUs", len(nodes) - len(gpu_nodes))
        spec = _build(DeviceSpec, "device", device or _ray_accelerator(gpu_nodes), DEVICE_SPECS)
        return _RayLayout(spec, len(gpu_nodes), _min_count(gpu_nodes, "GPU"), 1, "nccl")
    cpu_nodes = [n for n in nodes if int(n.get("Resources", {}).get("CPU", 0)) >= 1]
    if not cpu_nodes:
        raise ClusterSpecError(f"the Ray cluster has no alive node with a GPU or CPU (alive: "
                               f"{[_node_name(n) for n in nodes]}). Fix: start workers with `ray start "
                               "--address=...`, or pass address= of a running cluster.")
    cpus = _min_count(cpu_nodes, "CPU")
    per_host = min(cpus, _MAX_CPU_DEVICES_PER_HOST)
    threads = max(1, cpus // per_host)
    if device is None:
        memories = [n["Resources"].get("memory", 0) for n in cpu_nodes]
        memory = min(memories) if all(memories) else _host_memory_bytes()
        device = _cpu_device(memory // per_host, threads)
    spec = _build(DeviceSpec, "device", device, DEVICE_SPECS)
    return _RayLayout(spec, len(cpu_nodes), per_host, threads, "gloo")


def _min_count(nodes: list[Mapping[str, Any]], resource: str) -> int:
    """Smallest whole count of ``resource`` over ``nodes``; warns when some nodes have more."""
    counts = {_node_name(n): int(n["Resources"][resource]) for n in nodes}
    low = min(counts.values())
    if len(set(counts.values())) > 1:
        logger.warning("Ray nodes have different %s counts %s; using %d per host, the rest stay idle",
                       resource, counts, low)
    return low


def _ray_accelerator(nodes: list[Mapping[str, Any]]) -> str:
    """Built-in device name for the GPUs Ray reports; error if nodes disagree or the type is unknown."""
    prefix = "accelerator_type:"
    types = {_node_name(n): next((k.removeprefix(prefix) for k in sorted(n["Resources"]) if k.startswith(prefix)),
                                 None) for n in nodes}
    if len(set(types.values())) > 1:
        raise ClusterSpecError(f"Ray GPU nodes have different accelerator types {types}; a Cluster has one "
                               "device type. Fix: use nodes of one type, or pass device=<name> to plan for "
                               "the slowest one.")
    accelerator = next(iter(types.values()))
    if accelerator not in _RAY_ACCELERATORS:
        raise ClusterSpecError(f"Ray reports accelerator type {accelerator!r} on {sorted(types)}, which has no "
                               f"built-in spec. Fix: pass device= one of {sorted(DEVICE_SPECS)} or a DeviceSpec.")
    if accelerator == "A100":
        logger.warning("Ray reports 'A100' without a memory size; assuming a100-40gb (pass device= to override)")
    return _RAY_ACCELERATORS[accelerator]


def cluster_from_ray(address: str | None = None, device: str | DeviceSpec | None = None, *,
                     intra: str | LinkSpec | None = None, inter: str | LinkSpec | None = None) -> Cluster:
    """The Ray cluster this process is connected to (or connects to via ``ray.init(address)``).

    Hosts are the alive nodes with GPUs (CPU-only nodes such as a head are then skipped) or,
    without GPUs anywhere, the alive nodes with CPUs. Devices per host is the smallest count
    over those nodes; extra CPUs become threads. ``intra`` / ``inter``: link names or specs
    (default by device)."""
    layout = read_ray_layout(address, device)
    return Cluster.discovered(layout.num_hosts, layout.devices_per_host, layout.device, layout.backend,
                              layout.threads_per_device, intra=intra, inter=inter)


def hosts_left(cluster: Cluster) -> Cluster | None:
    """``cluster`` cut to the hosts Ray reports alive now, when fewer than its own (same device,
    links and threads; as many devices per host as before, or fewer if every node has fewer);
    None when all of its hosts are there. Raises ``ClusterSpecError`` when none is left."""
    import dataclasses

    layout = read_ray_layout(None, cluster.device)
    per_host = min(layout.devices_per_host, cluster.devices_per_host)
    if layout.num_hosts >= cluster.num_hosts and per_host == cluster.devices_per_host:
        return None
    return dataclasses.replace(cluster, num_hosts=min(layout.num_hosts, cluster.num_hosts), devices_per_host=per_host)
