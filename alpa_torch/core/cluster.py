"""The cluster: hosts × devices, what a device can do, what links cost.

Owns the hardware description the planner reads (``DeviceSpec``, ``LinkSpec``,
``Cluster``), built-in specs from NVIDIA datasheets, and the Alpa submesh and
logical-mesh enumeration (docs/design.md, "The planning problem"). It does not
estimate operator or collective costs (``intra_ilp`` does that from these
numbers) and never starts workers (``runtime`` does). Inputs come from the user:
``Cluster.local`` / ``simulated`` / a dict, JSON or YAML file; the runtime makes one from a
running Ray cluster (``runtime.discovery.cluster_from_ray``) or calibrates one by measuring
its workers (``runtime.profile.profile_cluster``): a value type never talks to Ray itself.

Device numbering is host-major everywhere: local device ``i`` of host ``h`` is
global device ``h * devices_per_host + i``. A submesh is ``(hosts, devices)``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import yaml

from alpa_torch.core.errors import ClusterSpecError

logger = logging.getLogger(__name__)

Shape = tuple[int, int]

_BACKENDS = ("gloo", "nccl")
GiB = 2**30
"""Bytes per GiB (device memories, budgets and reports are in bytes; tables print GiB)."""
# At most this many virtual CPU devices per Ray host; extra CPUs become threads.
_MAX_CPU_DEVICES_PER_HOST = 8


def _fail(owner: str, name: str, value: object, need: str, fix: str) -> NoReturn:
    raise ClusterSpecError(f"{owner}.{name} = {value!r} is invalid: {need}. Fix: {fix}.")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_positive(owner: str, name: str, value: object, fix: str) -> None:
    if not _is_number(value) or value <= 0:
        _fail(owner, name, value, "must be a finite number > 0", fix)


def _check_count(owner: str, name: str, value: object, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(owner, name, value, "must be an integer >= 1", fix)


# Collectives the cost model prices; ``Cluster.collective_beta_scale`` keys (case, '_' and '-' ignored).
COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall", "p2p")


def _canonical_collective(key: object) -> str:
    name = str(key).lower().replace("_", "").replace("-", "")
    if not isinstance(key, str) or name not in COLLECTIVES:
        _fail("Cluster", "collective_beta_scale", key, f"keys must name a collective, one of {COLLECTIVES}",
              "spell it like 'allgather' or 'all_gather'")
    return name


COST_KINDS = ("compute", "update", "transfer")
"""The kinds of cost ``Cluster.cost_correction`` corrects: a stage's forward and backward
programs (with the collectives inside them), its update (the optimizer step and the wait
for gradient reductions), and its cross-stage sends and receives."""


def submesh_key(submesh: Shape) -> str:
    """How ``cost_correction`` names a submesh: (2, 4) -> '2x4'."""
    return f"{submesh[0]}x{submesh[1]}"


def _key_size(key: object) -> int:
    """Devices of a submesh named ``key`` ('2x4' -> 8); 0 if ``key`` names none."""
    match = re.fullmatch(r"([1-9][0-9]*)x([1-9][0-9]*)", key) if isinstance(key, str) else None
    return int(match[1]) * int(match[2]) if match else 0


def _host_memory_bytes() -> int:
    """Physical RAM of this machine (16 GiB if the OS will not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """One accelerator (or one virtual CPU device) as the cost model sees it."""

    name: str
    """Short name, e.g. 'a100-80gb'; a key of DEVICE_SPECS for built-ins."""
    peak_flops: dict[str, float] = field(hash=False)
    """Dense matmul peak per device in FLOP/s, keyed by dtype name
    ('float32', 'bfloat16', 'float16'); 'float32' is required (the fallback)."""
    memory_bandwidth_bytes_per_s: float
    """Device memory bandwidth, bytes/s (bounds memory-bound operators)."""
    memory_bytes: float
    """Device memory usable by one device, bytes."""
    compute_efficiency: float = 0.6
    """Fraction of peak a well-shaped matmul reaches, in (0, 1]."""
    op_overhead_s: float = 5e-6
    """Fixed cost of running one operator on a one-device mesh (plain tensors), seconds, on
    top of its roofline time: framework dispatch and the kernel launch (a few microseconds
    on a GPU). ``Cluster.profile`` measures it on the workers (a chain of tiny operators)."""
    sharded_op_overhead_s: float = 5e-6
    """The same on a multi-device mesh. The runtime runs the first step on DTensors (tens of
    microseconds of sharding propagation per operator) and replays later steps as the
    local kernels DTensor's rules imply (``runtime/replay.py``), so in steady state this
    is a plain call plus the replay's bookkeeping (~1 us)."""

    def __post_init__(self) -> None:
        owner = f"DeviceSpec({self.name!r})"
        if not isinstance(self.name, str) or not self.name:
            _fail("DeviceSpec", "name", self.name, "must be a non-empty string", "name the device")
        if not isinstance(self.peak_flops, Mapping) or "float32" not in self.peak_flops:
            _fail(owner, "peak_flops", self.peak_flops, "must be a dict with a 'float32' entry",
                  "give {'float32': FLOP/s, ...}; other dtypes fall back to float32")
        for dtype_name, flops in self.peak_flops.items():
            _check_positive(owner, f"peak_flops[{dtype_name!r}]", flops,
                            "give the datasheet dense matmul peak in FLOP/s")
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))  # own copy: no aliasing
        _check_positive(owner, "memory_bandwidth_bytes_per_s", self.memory_bandwidth_bytes_per_s,
                        "give the memory bandwidth in bytes/s, e.g. 2.039e12")
        _check_positive(owner, "memory_bytes", self.memory_bytes, "give the usable device memory in bytes")
        if not _is_number(self.compute_efficiency) or not 0 < self.compute_efficiency <= 1:
            _fail(owner, "compute_efficiency", self.compute_efficiency, "must be in (0, 1]",
                  "use the fraction of peak a large matmul reaches, e.g. 0.6")
        for name in ("op_overhead_s", "sharded_op_overhead_s"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                _fail(owner, name, value, "must be a finite number >= 0",
                      "give the fixed seconds per operator, e.g. 5e-6 (or profile the cluster)")

    def flops_per_s(self, dtype_name: str = "float32") -> float:
        """Datasheet peak for ``dtype_name`` ('torch.' prefix allowed); the float32 peak if unlisted.

        Not scaled by ``compute_efficiency``: the cost model applies that itself.
        """
        key = dtype_name.removeprefix("torch.")
        return float(self.peak_flops.get(key, self.peak_flops["float32"]))

    def effective_flops_per_s(self, dtype_name: str = "float32") -> float:
        """What a well-shaped matmul reaches: ``flops_per_s(dtype_name) * compute_efficiency``."""
        return self.flops_per_s(dtype_name) * self.compute_efficiency


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """A link as the alpha-beta model sees it: t(bytes) = alpha_s + bytes * beta_s_per_byte."""

    name: str
    """Short name, e.g. 'nvlink3'; a key of LINK_SPECS for built-ins."""
    alpha_s: float
    """Latency of one collective call, seconds."""
    bandwidth_bytes_per_s: float
    """Effective per-direction bandwidth per device, bytes/s."""

    def __post_init__(self) -> None:
        owner = f"LinkSpec({self.name!r})"
        if not isinstance(self.name, str) or not self.name:
            _fail("LinkSpec", "name", self.name, "must be a non-empty string", "name the link")
        if not _is_number(self.alpha_s) or self.alpha_s < 0:
            _fail(owner, "alpha_s", self.alpha_s, "must be a finite number >= 0",
                  "give the per-call latency in seconds, e.g. 1e-5")
        _check_positive(owner, "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s,
                        "give the per-direction bandwidth in bytes/s, e.g. 25e9")

    @property
    def beta_s_per_byte(self) -> float:
        """Seconds per byte moved: 1 / bandwidth."""
        return 1.0 / self.bandwidth_bytes_per_s


_TERA = 1e12
# Sources: NVIDIA datasheets (dense peaks; sparsity figures halved away).
DEVICE_SPECS: dict[str, DeviceSpec] = {
    # A virtual CPU device = one core; modest defaults, memory = host RAM
    # (Cluster.local divides it by the device count). Profiled, so efficiency 1.
    # bf16/fp16 are not listed: mixed precision is priced at the float32 rate
    # unless Cluster.profile measured them (it times bfloat16 matmuls too).
    # Operator overheads measured on the development machine (torch 2.13, one thread, tiny
    # tensors): ~1.5 us per plain aten call; ~35 us per DTensor call, which only the first
    # step pays (later steps replay local kernels: about a plain call's cost).
    "cpu": DeviceSpec(name="cpu", peak_flops={"float32": 50e9}, memory_bandwidth_bytes_per_s=10e9,
                      memory_bytes=_host_memory_bytes(), compute_efficiency=1.0,
                      op_overhead_s=2e-6, sharded_op_overhead_s=3e-6),
    # NVIDIA Tesla V100 SXM2 datasheet: FP32 15.7, tensor FP16 125 TFLOP/s, HBM2 900 GB/s.
    # No bf16 tensor cores: bfloat16 falls back to the float32 peak.
    "v100-16gb": DeviceSpec(name="v100-16gb", peak_flops={"float32": 15.7 * _TERA, "float16": 125 * _TERA},
                            memory_bandwidth_bytes_per_s=900e9, memory_bytes=16 * GiB),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM): FP32 19.5 (TF32 156), BF16/FP16 312 TFLOP/s.
    "a100-40gb": DeviceSpec(name="a100-40gb", peak_flops={"float32": 19.5 * _TERA, "tfloat32": 156 * _TERA,
                                                          "bfloat16": 312 * _TERA, "float16": 312 * _TERA},
                            memory_bandwidth_bytes_per_s=1555e9, memory_bytes=40 * GiB),
    "a100-80gb": DeviceSpec(name="a100-80gb", peak_flops={"float32": 19.5 * _TERA, "tfloat32": 156 * _TERA,
                                                          "bfloat16": 312 * _TERA, "float16": 312 * _TERA},
                            memory_bandwidth_bytes_per_s=2039e9, memory_bytes=80 * GiB),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): FP32 67, BF16/FP16 989 dense, 3.35 TB/s.
    "h100-80gb": DeviceSpec(name="h100-80gb", peak_flops={"float32": 67 * _TERA, "bfloat16": 989 * _TERA,
                                                          "float16": 989 * _TERA},
                            memory_bandwidth_bytes_per_s=3.35e12, memory_bytes=80 * GiB),
    # NVIDIA DGX B200 / HGX B200 datasheet, per GPU: BF16/FP16 2.25 PFLOP/s dense, FP32 80,
    # HBM3e 8 TB/s, 180 GB usable.
    "b200": DeviceSpec(name="b200", peak_flops={"float32": 80 * _TERA, "bfloat16": 2250 * _TERA,
                                                "float16": 2250 * _TERA},
                       memory_bandwidth_bytes_per_s=8e12, memory_bytes=180e9),
}

# Effective per-direction bandwidth per device; alphas are typical NCCL/gloo call latencies.
LINK_SPECS: dict[str, LinkSpec] = {
    "nvlink2": LinkSpec(name="nvlink2", alpha_s=10e-6, bandwidth_bytes_per_s=150e9),  # V100 SXM2
    "nvlink3": LinkSpec(name="nvlink3", alpha_s=8e-6, bandwidth_bytes_per_s=300e9),  # A100 SXM
    "nvlink4": LinkSpec(name="nvlink4", alpha_s=6e-6, bandwidth_bytes_per_s=450e9),  # H100 SXM
    "nvlink5": LinkSpec(name="nvlink5", alpha_s=5e-6, bandwidth_bytes_per_s=900e9),  # B200
    "pcie4": LinkSpec(name="pcie4", alpha_s=10e-6, bandwidth_bytes_per_s=25e9),  # PCIe 4.0 x16
    "ib-200g": LinkSpec(name="ib-200g", alpha_s=20e-6, bandwidth_bytes_per_s=25e9),  # HDR InfiniBand
    "ib-400g": LinkSpec(name="ib-400g", alpha_s=15e-6, bandwidth_bytes_per_s=50e9),  # NDR InfiniBand
    "eth-25g": LinkSpec(name="eth-25g", alpha_s=50e-6, bandwidth_bytes_per_s=3.125e9),
    "eth-100g": LinkSpec(name="eth-100g", alpha_s=50e-6, bandwidth_bytes_per_s=12.5e9),
    # Measured on the development machine: gloo between local processes.
    "gloo-local": LinkSpec(name="gloo-local", alpha_s=0.3e-3, bandwidth_bytes_per_s=1.4e9),
}

# Default (intra, inter) links per device, for clusters read from Ray.
_DEFAULT_LINKS = {"v100-16gb": ("nvlink2", "ib-200g"), "a100-40gb": ("nvlink3", "ib-200g"),
                  "a100-80gb": ("nvlink3", "ib-200g"), "h100-80gb": ("nvlink4", "ib-400g"),
                  "b200": ("nvlink5", "ib-400g"), "cpu": ("gloo-local", "eth-25g")}


def _lookup(kind: str, table: Mapping[str, Any], name: str) -> Any:
    if name not in table:
        raise ClusterSpecError(f"unknown {kind} {name!r}. Fix: use one of {', '.join(sorted(table))}, "
                               f"or pass a dict with the {kind} fields.")
    return table[name]


def _build(cls: type, kind: str, value: Any, table: Mapping[str, Any]) -> Any:
    """A DeviceSpec/LinkSpec from a spec, a built-in name, or a dict (a built-in name in it fills gaps)."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        return _lookup(kind, table, value)
    if not isinstance(value, Mapping):
        raise ClusterSpecError(f"{kind} = {value!r} is invalid. Fix: give a name ({', '.join(sorted(table))}) "
                               "or a dict of its fields.")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise ClusterSpecError(f"{kind} has unknown keys {unknown}. Fix: use only {sorted(fields)}.")
    if value.get("name") in table:
        return dataclasses.replace(table[value["name"]], **value)
    missing = sorted(f.name for f in dataclasses.fields(cls)
                     if f.name not in value and f.default is dataclasses.MISSING)
    if missing:
        raise ClusterSpecError(f"{kind} {dict(value)!r} lacks keys {missing}. Fix: add them, "
                               f"or name a built-in ({', '.join(sorted(table))}).")
    return cls(**value)


def _cpu_device(memory_bytes: float, threads_per_device: int) -> DeviceSpec:
    """The built-in CPU spec with ``threads_per_device`` cores per device (compute scales, bandwidth not)."""
    base = DEVICE_SPECS["cpu"]
    flops = {k: v * threads_per_device for k, v in base.peak_flops.items()}
    return dataclasses.replace(base, peak_flops=flops, memory_bytes=memory_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """``num_hosts`` identical hosts, each with ``devices_per_host`` identical devices."""

    num_hosts: int
    """Number of machines, N."""
    devices_per_host: int
    """Devices per machine, M."""
    device: DeviceSpec
    """What each device can do."""
    intra_host_link: LinkSpec
    """Link between devices of one host (NVLink, PCIe, local gloo)."""
    inter_host_link: LinkSpec
    """Link between hosts (InfiniBand, Ethernet)."""
    backend: str
    """torch.distributed backend: 'gloo' (CPU) or 'nccl' (GPU)."""
    threads_per_device: int = 1
    """torch threads per device; used for local CPU devices."""
    is_local: bool = False
    """True when the devices are virtual CPU devices on this machine."""
    collective_beta_scale: dict[str, float] = field(default_factory=dict, hash=False)
    """Multiplier on a link's β (seconds per byte) per collective, keyed by a name in ``COLLECTIVES``
    ('allgather', 'reducescatter', ...); a missing key means 1.0. On gloo, all-gather and
    reduce-scatter move bytes 3-4x slower than all-reduce (docs/design.md); NCCL's ratios are near 1.
    ``profile`` measures them. Keys are stored in canonical form ('all_gather' -> 'allgather')."""
    profiled: dict[str, Any] = field(default_factory=dict, hash=False)
    """Empty, or what ``profile`` measured and fitted (date, sizes, raw timings, per-collective
    alpha/beta): plain JSON data, kept so a person can check the calibration."""
    cost_correction: dict[str, dict[str, float]] = field(default_factory=dict, hash=False)
    """Measured over predicted time per kind of cost (``COST_KINDS``) and submesh
    (``submesh_key``: '2x2'), learnt from steps the runtime recorded (``alpa_torch.calibration``);
    the stage DP multiplies a stage's figures by them (``correction``). Empty: the cost model alone."""

    def __post_init__(self) -> None:
        _check_count("Cluster", "num_hosts", self.num_hosts, "give the number of machines, at least 1")
        _check_count("Cluster", "devices_per_host", self.devices_per_host,
                     "give the devices (GPUs or virtual CPU devices) per machine, at least 1")
        _check_count("Cluster", "threads_per_device", self.threads_per_device, "use 1 or more threads")
        for name, value, cls in (("device", self.device, DeviceSpec), ("intra_host_link", self.intra_host_link,
                                 LinkSpec), ("inter_host_link", self.inter_host_link, LinkSpec)):
            if not isinstance(value, cls):
                _fail("Cluster", name, value, f"must be a {cls.__name__}",
                      "build it with Cluster.from_dict, which accepts names and dicts")
        if self.backend not in _BACKENDS:
            _fail("Cluster", "backend", self.backend, f"must be one of {_BACKENDS}", "use 'gloo' on CPU, 'nccl' on GPU")
        if not isinstance(self.is_local, bool):
            _fail("Cluster", "is_local", self.is_local, "must be a bool", "use True or False")
        if self.is_local and self.backend != "gloo":
            _fail("Cluster", "backend", self.backend, "local virtual CPU devices need 'gloo'", "use backend='gloo'")
        self._check_calibration()

    def _check_calibration(self) -> None:
        """Validate and own-copy ``collective_beta_scale`` and ``profiled`` (no aliasing of the caller's dicts)."""
        if not isinstance(self.collective_beta_scale, Mapping):
            _fail("Cluster", "collective_beta_scale", self.collective_beta_scale, "must be a dict",
                  "give {'allgather': 3.5, ...} or leave it out")
        scales = {}
        for key, value in self.collective_beta_scale.items():
            name = _canonical_collective(key)
            _check_positive("Cluster", f"collective_beta_scale[{key!r}]", value,
                            "give the collective's beta divided by the link's (all-reduce) beta")
            if name in scales:
                _fail("Cluster", "collective_beta_scale", key, f"names {name!r} twice", "keep one spelling")
            scales[name] = float(value)
        object.__setattr__(self, "collective_beta_scale", scales)
        if not isinstance(self.profiled, Mapping):
            _fail("Cluster", "profiled", self.profiled, "must be a dict", "leave it to runtime.profile.profile_cluster")
        try:
            plain = json.loads(json.dumps(dict(self.profiled), allow_nan=False))
        except (TypeError, ValueError) as exc:
            _fail("Cluster", "profiled", self.profiled, f"must be plain JSON data ({exc})",
                  "use str keys, lists, finite numbers and strings")
        if plain != self.profiled:
            _fail("Cluster", "profiled", self.profiled, "must survive a JSON round trip unchanged",
                  "use str keys and lists, not int keys or tuples")
        object.__setattr__(self, "profiled", plain)
        if not isinstance(self.cost_correction, Mapping):
            _fail("Cluster", "cost_correction", self.cost_correction, "must be a dict",
                  "leave it to alpa_torch.calibration, or give {'compute': {'1x2': 0.8}, ...}")
        corrections = {}
        for kind, table in self.cost_correction.items():
            if kind not in COST_KINDS or not isinstance(table, Mapping):
                _fail("Cluster", "cost_correction", {kind: table}, f"keys must be one of {COST_KINDS}, each "
                      "mapping submeshes to factors", "give {'compute': {'1x2': 0.8}, ...}")
            for key, value in table.items():
                if not _key_size(key):
                    _fail("Cluster", f"cost_correction[{kind!r}]", key, "keys must name a submesh like '2x4'",
                          "write hosts x devices, e.g. '1x2'")
                _check_positive("Cluster", f"cost_correction[{kind!r}][{key!r}]", value,
                                "give the measured over the predicted time")
            corrections[kind] = {key: float(value) for key, value in sorted(table.items())}
        object.__setattr__(self, "cost_correction", corrections)

    def correction(self, kind: str, submesh: Shape) -> float:
        """The factor ``cost_correction`` gives a cost of ``kind`` on a stage of ``submesh``: its
        own, else that of the measured submesh nearest in device count (on a log scale; the
        larger on a tie), else 1.0 (nothing of that kind measured)."""
        table = self.cost_correction.get(kind)
        if not table:
            return 1.0
        key = submesh_key(submesh)
        if key in table:
            return table[key]
        size = math.log(submesh[0] * submesh[1])
        nearest = min(table, key=lambda k: (abs(math.log(_key_size(k)) - size), -_key_size(k), k))
        return table[nearest]

    def beta_scale(self, collective: str) -> float:
        """``collective_beta_scale`` for ``collective`` (any spelling of a name in ``COLLECTIVES``), 1.0 if unset."""
        return self.collective_beta_scale.get(_canonical_collective(collective), 1.0)
    @property
    def device_type(self) -> str:
        """The torch device type of its devices: 'cuda' on NCCL clusters, 'cpu' on gloo ones."""
        return "cuda" if self.backend == "nccl" else "cpu"

    @property
    def num_devices(self) -> int:
        """N × M."""
        return self.num_hosts * self.devices_per_host

    # ---------------------------------------------------------------- constructors
    @classmethod
    def local(cls, hosts: int, devices_per_host: int, *, memory_bytes: float | None = None,
              threads_per_device: int = 1) -> Cluster:
        """``hosts`` × ``devices_per_host`` virtual CPU devices on this machine, talking over gloo."""
        _check_count("Cluster", "threads_per_device", threads_per_device, "use 1 or more threads")
        if memory_bytes is None:  # bad counts get 1 here and a clear error from __post_init__
            counts_ok = all(isinstance(x, int) and x > 0 for x in (hosts, devices_per_host))
            memory_bytes = _host_memory_bytes() // (hosts * devices_per_host if counts_ok else 1)
        link = LINK_SPECS["gloo-local"]
        return cls(num_hosts=hosts, devices_per_host=devices_per_host,
                   device=_cpu_device(memory_bytes, threads_per_device), intra_host_link=link,
                   inter_host_link=link, backend="gloo", threads_per_device=threads_per_device, is_local=True)

    @classmethod
    def simulated(cls, hosts: int, devices_per_host: int, device: str | DeviceSpec = "a100-80gb",
                  intra: str | LinkSpec = "nvlink3", inter: str | LinkSpec = "ib-200g") -> Cluster:
        """A cluster that need not exist, for planning only (e.g. 4 × 8 H100)."""
        spec = _build(DeviceSpec, "device", device, DEVICE_SPECS)
        return cls(num_hosts=hosts, devices_per_host=devices_per_host, device=spec,
                   intra_host_link=_build(LinkSpec, "link", intra, LINK_SPECS),
                   inter_host_link=_build(LinkSpec, "link", inter, LINK_SPECS),
                   backend="gloo" if spec.name == "cpu" else "nccl")

    @classmethod
    def discovered(cls, num_hosts: int, devices_per_host: int, device: DeviceSpec, backend: str,
                   threads_per_device: int, *, intra: str | LinkSpec | None = None,
                   inter: str | LinkSpec | None = None) -> Cluster:
        """A cluster of real hosts as found on a running Ray cluster (``runtime.discovery``):
        the links default by device (``_DEFAULT_LINKS``) unless given."""
        default_intra, default_inter = _DEFAULT_LINKS.get(device.name, ("pcie4", "ib-200g"))
        return cls(num_hosts=num_hosts, devices_per_host=devices_per_host, device=device,
                   intra_host_link=_build(LinkSpec, "link", intra or default_intra, LINK_SPECS),
                   inter_host_link=_build(LinkSpec, "link", inter or default_inter, LINK_SPECS),
                   backend=backend, threads_per_device=threads_per_device)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Cluster:
        """Inverse of ``to_dict``; ``device`` and the links may also be built-in names, or
        dicts naming a built-in and overriding some fields. ``backend`` defaults by device."""
        if not isinstance(d, Mapping):
            raise ClusterSpecError(f"a cluster description must be a dict, got {d!r}. Fix: pass a mapping "
                                   "with num_hosts, devices_per_host, device, intra_host_link, inter_host_link.")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(allowed))
        missing = [k for k in _REQUIRED_KEYS if k not in d]
        if unknown or missing:
            raise ClusterSpecError(f"cluster description has unknown keys {unknown} and lacks keys {missing}. "
                                   f"Fix: use the keys {allowed} (backend, threads_per_device, is_local, "
                                   "collective_beta_scale, profiled, cost_correction optional).")
        kwargs = dict(d)
        kwargs["device"] = _build(DeviceSpec, "device", d["device"], DEVICE_SPECS)
        kwargs["intra_host_link"] = _build(LinkSpec, "link", d["intra_host_link"], LINK_SPECS)
        kwargs["inter_host_link"] = _build(LinkSpec, "link", d["inter_host_link"], LINK_SPECS)
        kwargs.setdefault("backend", "gloo" if kwargs["device"].name == "cpu" else "nccl")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (JSON/YAML-ready), with full device and link fields."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Cluster:
        """Load a cluster written by ``to_json`` (or by hand)."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ClusterSpecError(f"{str(path)!r} is not valid JSON ({exc}). Fix: write it with "
                                   "Cluster.to_json or check the syntax.") from exc
        return cls.from_dict(data)

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write ``to_dict()`` as JSON; ``from_json`` gives back an equal cluster."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> Cluster:
        """Load a YAML cluster description (same keys as ``from_dict``; 25e9 reads as a number)."""
        try:
            data = yaml.load(Path(path).read_text(), Loader=_YamlLoader)  # a SafeLoader
        except yaml.YAMLError as exc:
            raise ClusterSpecError(f"{str(path)!r} is not valid YAML ({exc}). Fix: check the syntax.") from exc
        return cls.from_dict(data)

    def to_yaml(self, path: str | os.PathLike[str]) -> None:
        """Write ``to_dict()`` as YAML; ``from_yaml`` gives back an equal cluster."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    # ------------------------------------------------------- submeshes (Alpa §5)
    def submesh_shapes(self) -> tuple[Shape, ...]:
        """Alpa's submesh shapes by device count: (1, 2^k) for 2^k <= M, and (n, M) for n = 1..N."""
        n_hosts, m = self.num_hosts, self.devices_per_host
        shapes = {(1, 2**k) for k in range(m.bit_length())} | {(n, m) for n in range(1, n_hosts + 1)}
        return tuple(sorted(shapes, key=lambda s: (s[0] * s[1], s)))

    def _check_submesh(self, submesh: Shape) -> Shape:
        shapes = self.submesh_shapes()
        shape = tuple(submesh) if isinstance(submesh, (tuple, list)) else submesh
        if shape not in shapes:
            raise ClusterSpecError(f"submesh {submesh!r} is not a submesh of this {self.num_hosts}x"
                                   f"{self.devices_per_host} cluster. Fix: use one of {list(shapes)}.")
        return shape

    def logical_mesh_shapes(self, submesh: Shape) -> tuple[Shape, ...]:
        """Every 2D (a, b) with a * b = devices of ``submesh``, a ascending: 2x4 -> (1,8),(2,4),(4,2),(8,1)."""
        n, m = self._check_submesh(submesh)
        count = n * m
        return tuple((a, count // a) for a in range(1, count + 1) if count % a == 0)

    def mesh_axis_links(self, submesh: Shape, logical_shape: Shape) -> tuple[LinkSpec, LinkSpec]:
        """The link each axis of ``logical_shape`` uses on ``submesh``.

        Devices are numbered host-major (host h, local device i -> h * m + i) and laid
        row-major into (a, b); an axis whose device groups each lie inside one host
        uses ``intra_host_link``, otherwise ``inter_host_link``.
        """
        n, m = self._check_submesh(submesh)
        shapes = self.logical_mesh_shapes((n, m))
        shape = tuple(logical_shape) if isinstance(logical_shape, (tuple, list)) else logical_shape
        if shape not in shapes:
            raise ClusterSpecError(f"logical shape {logical_shape!r} does not fit submesh {(n, m)}. "
                                   f"Fix: use one of {list(shapes)}.")
        a, b = shape
        axis0_groups = [range(j, a * b, b) for j in range(b)]  # columns
        axis1_groups = [range(r * b, (r + 1) * b) for r in range(a)]  # rows
        return tuple(  # type: ignore[return-value]
            self.intra_host_link if all(len({k // m for k in g}) == 1 for g in groups) else self.inter_host_link
            for groups in (axis0_groups, axis1_groups))

    def link_between(self, devices: Iterable[int], others: Iterable[int] = ()) -> LinkSpec:
        """The link that traffic among global device ids ``devices`` and ``others`` crosses: the
        intra-host link if they all sit on one host, else the inter-host link."""
        hosts = {d // self.devices_per_host for d in (*devices, *others)}
        return self.intra_host_link if len(hosts) <= 1 else self.inter_host_link

    def submesh_device_ids(self, submesh: Shape, offset: int) -> tuple[int, ...]:
        """Global device ids (host-major) of ``submesh`` placed with its first device at ``offset``.

        A (1, m) submesh must fit inside one host; an (n, M) one must start at a host boundary.
        """
        n, m = self._check_submesh(submesh)
        per_host = self.devices_per_host
        ok = isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0
        host, first = divmod(offset, per_host) if ok else (0, 0)
        if not ok or host + n > self.num_hosts or first + m > per_host:
            raise ClusterSpecError(
                f"submesh {(n, m)} cannot start at global device {offset!r} of this {self.num_hosts}x{per_host} "
                f"cluster: it must lie inside one host or start at a host boundary and end by device "
                f"{self.num_devices - 1}. Fix: use an offset h * {per_host} + i with i + {m} <= {per_host} "
                f"and h + {n} <= {self.num_hosts}.")
        return tuple(offset + h * per_host + i for h in range(n) for i in range(m))

    def describe(self) -> str:
        """One line a person can read: shape, device, links, backend."""
        dev = self.device
        dtype, peak = max(dev.peak_flops.items(), key=lambda kv: kv[1])

        def link(spec: LinkSpec) -> str:
            return f"{spec.name} {spec.bandwidth_bytes_per_s / 1e9:g} GB/s, alpha {spec.alpha_s * 1e6:g} us"

        text = (f"{self.num_hosts}x{self.devices_per_host} cluster = {self.num_devices} x {dev.name} "
                f"({peak / 1e12:g} TFLOP/s {dtype} peak, {dev.memory_bytes / GiB:.1f} GiB, "
                f"{dev.memory_bandwidth_bytes_per_s / 1e9:g} GB/s); intra-host {link(self.intra_host_link)}; "
                f"inter-host {link(self.inter_host_link)}; backend {self.backend}")
        if self.is_local:
            text += f"; local virtual CPU devices, {self.threads_per_device} thread(s) each"
        if self.collective_beta_scale:
            text += "; beta x " + ", ".join(f"{k} {v:.2g}" for k, v in self.collective_beta_scale.items())
        if self.profiled:
            text += f"; profiled {self.profiled.get('date', '?')}"
        return text


_REQUIRED_KEYS = ("num_hosts", "devices_per_host", "device", "intra_host_link", "inter_host_link")


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads 25e9 and 1.4e9 as floats (YAML 1.1 wants '25.0e+9')."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)
