"""Getting a Ray cluster to run the workers on, and sizing each worker for it.

Owns three things: connecting to (or starting) Ray (``ensure_ray`` /
``stop_ray``), checking that the ``Cluster`` the plan is for fits the Ray
cluster *before* any actor starts (``plan_resources``), and the Ray resources
each device's actor and placement-group bundle asks for (``ResourcePlan``).
It does not start actors or process groups (``runtime/group.py`` does).

Inputs: an ``alpa_torch.core.cluster.Cluster`` and optionally a Ray address (the
argument, else ``RAY_ADDRESS``). Without one, a private local Ray is started with
``address="local"``: never someone else's Ray on this machine (plain
``ray.init()`` would join the last cluster named in /tmp/ray). It is asked for
127.0.0.1, but Ray 2.60 on Linux advertises the machine's routable IP anyway;
the torch.distributed rendezvous of local devices does use 127.0.0.1.

Ray 2.60 token authentication: a fresh ``ray.init()`` turns token auth on and
reads (or writes) ``~/.ray/auth_token``, so a start would depend on the home
directory (a stale token, an unwritable HOME). When the user has not
configured auth (no ``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``,
``RAY_AUTH_TOKEN_PATH``), ``ensure_ray`` instead sets ``RAY_AUTH_MODE=token``
and a random ``RAY_AUTH_TOKEN`` in this process's environment (Ray's own
processes inherit it) once per process; nothing is read from or written to the
home directory. An explicit user setting is always respected.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from alpa_torch.core.cluster import Cluster
from alpa_torch.core.errors import ClusterSpecError

logger = logging.getLogger(__name__)

_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
# Ray accepts fractional resources below 1 with this granularity; above 1 only whole numbers.
_RAY_RESOURCE_STEP = 1e-4


@dataclass(frozen=True, kw_only=True, slots=True)
class ResourcePlan:
    """What each device's actor asks Ray for, and how the placement group is laid out."""

    cpus_per_device: float
    """Ray CPUs per device actor: ``threads_per_device``, or a fraction when oversubscribed."""
    gpus_per_device: int
    """1 on NCCL (GPU) clusters, 0 on gloo (CPU) clusters."""
    bundles: tuple[dict[str, float], ...]
    """Placement-group bundles: one per device (local) or one per host (real hosts)."""
    strategy: str
    """Placement strategy: PACK (local: all on one node if it fits) or STRICT_SPREAD (one node per host)."""

    def bundle_index(self, rank: int, devices_per_host: int) -> int:
        """The bundle device ``rank`` is scheduled into."""
        return rank if self.strategy == "PACK" else rank // devices_per_host


def ensure_ray(cluster: Cluster, *, address: str | None = None, log_to_driver: bool = False) -> bool:
    """Make sure this process is connected to a Ray cluster that can hold ``cluster``.

    Uses an initialised Ray as is; else connects to ``address`` or ``RAY_ADDRESS``;
    else starts a private local Ray (no dashboard) with enough logical CPUs for every
    device's threads. Returns True only when this call started Ray (so only the
    starter stops it). Raises ``ClusterSpecError`` naming the numbers when the
    Ray cluster is too small, after stopping a Ray it started itself.
    """
    import ray  # heavy; only the runtime needs it

    started = False
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or None
        if address:
            logger.info("connecting to Ray at %s", address)
            ray.init(address=address, log_to_driver=log_to_driver)
        else:
            _start_local_ray(cluster, log_to_driver)
            started = True
    try:
        plan_resources(cluster, alive_nodes())
    except ClusterSpecError:
        if started:
            stop_ray()
        raise
    return started


def stop_ray() -> None:
    """``ray.shutdown()``; the auth variables set by ``ensure_ray`` stay for the next start."""
    import ray

    ray.shutdown()


def local_ray_cpus(cluster: Cluster) -> int:
    """Logical CPUs a local Ray gets: every device's threads, at least one per device."""
    return max(cluster.num_devices * cluster.threads_per_device, cluster.num_devices)


def _start_local_ray(cluster: Cluster, log_to_driver: bool) -> None:
    import ray

    if _configure_token_auth(os.environ):
        _refresh_ray_auth_config()
    gpu = cluster.backend == "nccl"
    num_cpus = None if gpu else local_ray_cpus(cluster)  # GPU hosts: let Ray count real CPUs and GPUs
    logger.info("starting a local Ray on 127.0.0.1 with num_cpus=%s", num_cpus)
    # Ray 2.60 on Linux maps _node_ip_address='127.0.0.1' to the routable IP anyway
    # (services.resolve_ip_for_localhost); token auth guards it. No prestarted idle workers: our actors
    # carry a runtime_env, so they cannot reuse them, and num_cpus of them would only load the cores.
    ray.init(address="local", num_cpus=num_cpus, num_gpus=None if gpu else 0, include_dashboard=False,
             log_to_driver=log_to_driver, _node_ip_address="127.0.0.1",
             _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False})


def _configure_token_auth(environ: MutableMapping[str, str]) -> bool:
    """Token auth with a random token in ``environ``, unless the user configured auth; True if set here."""
    if any(var in environ for var in _AUTH_VARS):
        return False
    environ["RAY_AUTH_MODE"] = "token"
    environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # 256 bits, like `ray get-auth-token --generate`
    return True


def _refresh_ray_auth_config() -> None:
    """Make this process see the auth variables just set.

    Its RayConfig and token cache were read when ray was imported (a start then fails
    with "RAY_AUTH_MODE is currently 'disabled'"); Ray's own ``_enable_token_auth``
    refreshes them the same way: config first, then the token cache.
    """
    from ray._raylet import AuthenticationTokenLoader, Config  # private, Ray 2.60

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def alive_nodes() -> list[Mapping[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def _floor_resource(value: float) -> float:
    """Round ``value`` down to a quantity Ray accepts (whole above 1, steps of 1e-4 below)."""
    if value >= 1:
        return float(math.floor(value))
    return math.floor(value / _RAY_RESOURCE_STEP) * _RAY_RESOURCE_STEP


def plan_resources(cluster: Cluster, nodes: list[Mapping[str, Any]]) -> ResourcePlan:
    """Size each device's actor for the Ray ``nodes`` (``ray.nodes()`` entries that are alive).

    Local clusters: all devices on the largest node, one bundle each, PACK; CPUs
    shared out evenly when the node has fewer than ``num_devices * threads``.
    Real hosts: one bundle per host (``devices_per_host`` GPUs, or CPUs), STRICT_SPREAD
    so each host is its own node. Raises ``ClusterSpecError`` when it cannot fit.
    """
    def count(node: Mapping[str, Any], resource: str) -> float:
        return float(node.get("Resources", {}).get(resource, 0))

    gpu = cluster.backend == "nccl"
    m = cluster.devices_per_host
    if cluster.is_local:
        node_cpus = max((count(n, "CPU") for n in nodes), default=0.0)
        cpus = _device_cpus(cluster, node_cpus, cluster.num_devices, "the largest Ray node")
        return ResourcePlan(cpus_per_device=cpus, gpus_per_device=0,
                            bundles=tuple({"CPU": cpus} for _ in range(cluster.num_devices)), strategy="PACK")
    kind = "GPU" if gpu else "CPU"
    need = m if gpu else 1
    fitting = [n for n in nodes if count(n, kind) >= need]
    if len(fitting) < cluster.num_hosts:
        have = sorted((count(n, kind) for n in nodes), reverse=True)
        raise ClusterSpecError(
            f"the cluster needs {cluster.num_hosts} Ray node(s) with >= {need} {kind} each "
            f"({cluster.num_hosts}x{m} devices), but the Ray cluster has {len(fitting)} such node(s) "
            f"(alive nodes' {kind} counts: {have}). Fix: add nodes, or plan for alpa_torch.cluster_from_ray().")
    # The num_hosts best-equipped nodes are the ones STRICT_SPREAD can use.
    node_cpus = sorted((count(n, "CPU") for n in fitting), reverse=True)[cluster.num_hosts - 1]
    cpus = _device_cpus(cluster, node_cpus, m, f"each of {cluster.num_hosts} Ray node(s)")
    bundle = {"CPU": _floor_resource(cpus * m)}
    if gpu:
        bundle["GPU"] = float(m)
    return ResourcePlan(cpus_per_device=cpus, gpus_per_device=int(gpu),
                        bundles=tuple(dict(bundle) for _ in range(cluster.num_hosts)), strategy="STRICT_SPREAD")


def _device_cpus(cluster: Cluster, node_cpus: float, devices_on_node: int, where: str) -> float:
    """``threads_per_device`` CPUs per device if ``node_cpus`` allows, else an even fraction (warned)."""
    want = float(cluster.threads_per_device)
    if devices_on_node * want <= node_cpus:
        return want
    share = _floor_resource(node_cpus / devices_on_node)
    if share <= 0:
        raise ClusterSpecError(
            f"{devices_on_node} device(s) must share {node_cpus:g} Ray CPU(s) on {where}: none left per device. "
            "Fix: give Ray CPUs (ray start --num-cpus=N) or use fewer devices.")
    logger.warning("%d device(s) x %d thread(s) oversubscribe %g Ray CPU(s) on %s; each actor gets %g CPU",
                   devices_on_node, cluster.threads_per_device, node_cpus, where, share)
    return share
