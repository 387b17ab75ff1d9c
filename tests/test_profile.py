"""Cluster profiling: the alpha-beta fit against synthetic timings (pure, fast), the calibrated
``Cluster`` fields, and one real profile of a 1x2 local cluster on Ray workers (a few seconds)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from alpa_torch.core.cluster import COLLECTIVES, Cluster
from alpa_torch.core.errors import ClusterSpecError
from intra_ilp import cost_model as cm
from runtime.profile import (
    ProfileError,
    _calibrated,
    _chunk_elems,
    _Plan,
    fit_alpha_beta,
    link_groups,
    profile_cluster,
    regressor_bytes,
)

_KiB, _MiB = 2**10, 2**20


# --------------------------------------------------------------------------- the fit (pure)
def test_fit_recovers_exact_alpha_beta():
    x = np.array([4e3, 6.5e4, 1e6, 4e6, 1.6e7])
    fit = fit_alpha_beta(x, 3e-4 + 7.5e-10 * x)
    assert fit.alpha_s == pytest.approx(3e-4, rel=1e-9)
    assert fit.beta_s_per_byte == pytest.approx(7.5e-10, rel=1e-9)
    assert fit.rel_rms < 1e-9


def test_fit_with_relative_noise_stays_close():
    rng = np.random.default_rng(0)
    x = np.repeat([4e3, 6.5e4, 1e6, 4e6, 1.6e7], 5)
    t = (3e-4 + 7.5e-10 * x) * rng.uniform(0.9, 1.1, x.size)  # +-10 % per sample
    fit = fit_alpha_beta(x, t)
    assert fit.alpha_s == pytest.approx(3e-4, rel=0.1)
    assert fit.beta_s_per_byte == pytest.approx(7.5e-10, rel=0.1)
    assert 0.01 < fit.rel_rms < 0.1


def test_fit_weighs_small_messages_like_large_ones():
    """A 1 ms error at 16 MiB must not swamp alpha (plain least squares would move alpha by ~0.5 ms)."""
    x = np.array([4e3, 6.5e4, 1e6, 4e6, 1.6e7])
    t = 3e-4 + 7.5e-10 * x
    t[-1] += 1e-3
    assert fit_alpha_beta(x, t).alpha_s == pytest.approx(3e-4, rel=0.05)


def test_fit_negative_intercept_clamps_alpha_to_zero():
    x = np.array([1e5, 1e6, 1e7])
    fit = fit_alpha_beta(x, 1e-9 * x - 5e-5)  # an exact line with intercept -50 us
    assert fit.alpha_s == 0.0 and fit.beta_s_per_byte > 0


@pytest.mark.parametrize("x, t", [([1e3], [1e-3]), ([1e3, 1e3], [1e-3, 2e-3]), ([1e3, 1e6], [2e-3, 1e-3]),
                                  ([1e3, 1e6], [0.0, 1e-3]), ([1e3, 1e6], [1e-3, math.nan])])
def test_fit_rejects_unfittable_timings(x, t):
    with pytest.raises(ProfileError):
        fit_alpha_beta(x, t)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_regressor_matches_the_cost_model(n):
    """alpha + beta * regressor_bytes is the cost model's own formula, for every collective."""
    alpha, beta, b = 1e-4, 1e-9, 12345.0
    mesh = cm.MeshCost(mesh_shape=(1, n), alpha_s=(alpha, alpha), beta_s_per_byte=(beta, beta),
                       peak_flops_per_s=1e12, memory_bandwidth_bytes_per_s=1e11)
    formulas = {"allreduce": cm.allreduce_s, "allgather": cm.allgather_s, "reducescatter": cm.reducescatter_s,
                "alltoall": cm.alltoall_s, "p2p": cm.p2p_s}
    for name in COLLECTIVES:
        assert formulas[name](mesh, 1, b) == pytest.approx(alpha + beta * regressor_bytes(name, b, n), rel=1e-12)


def test_link_groups_follow_mesh_axes():
    """Inter groups are the columns of an (N, M) mesh (axis 0 on the inter link), intra the rows."""
    cluster = Cluster.local(2, 4)
    groups = link_groups(cluster)
    assert groups == {"intra": [[0, 1, 2, 3], [4, 5, 6, 7]], "inter": [[0, 4], [1, 5], [2, 6], [3, 7]]}
    assert cluster.mesh_axis_links((2, 4), (2, 4)) == (cluster.inter_host_link, cluster.intra_host_link)
    assert link_groups(Cluster.local(1, 2)) == {"intra": [[0, 1]]} and link_groups(Cluster.local(1, 1)) == {}


def test_calibration_from_synthetic_measurements():
    """Two hosts x two devices, timings made from known alpha/beta: the new Cluster carries them exactly."""
    cluster, sizes = Cluster.local(2, 2, memory_bytes=2**30), (4 * _KiB, 1 * _MiB, 16 * _MiB)
    truth = {"intra": (3e-4, 7e-10, {"allgather": 3.5, "reducescatter": 3.0, "alltoall": 1.5, "p2p": 0.5}),
             "inter": (1e-3, 2e-9, {"allgather": 2.0, "reducescatter": 2.0, "alltoall": 1.0, "p2p": 0.8})}

    def times(kind):
        alpha, beta, scales = truth[kind]
        return {c: {str(b): alpha + beta * scales.get(c, 1.0) * regressor_bytes(c, _chunk_elems(b, 2) * 2 * 4, 2)
                    for b in sizes} for c in COLLECTIVES}

    rank = {"matmul_flops_per_s": {"float32": {"256": 8e10, "512": 1e11}}, "memory_bandwidth_bytes_per_s": 2e10,
            "links": {kind: times(kind) for kind in truth}}
    plan = _Plan(sizes_bytes=sizes, repeats=3, matmul_sizes=None, copy_bytes=None, groups=link_groups(cluster))
    out = _calibrated(cluster, [rank] * 4, plan)
    assert out.device.name == "cpu-profiled" and out.device.peak_flops == {"float32": 1e11}
    assert out.device.compute_efficiency == 1.0 and out.device.memory_bandwidth_bytes_per_s == 2e10
    assert out.device.memory_bytes == 2**30
    for link, kind in ((out.intra_host_link, "intra"), (out.inter_host_link, "inter")):
        assert link.name == "gloo-local-profiled"
        assert link.alpha_s == pytest.approx(truth[kind][0]) and link.beta_s_per_byte == pytest.approx(truth[kind][1])
    assert out.collective_beta_scale == pytest.approx(truth["intra"][2])  # the intra fit sets the scales
    assert out.profiled["links"]["inter"]["scales"] == pytest.approx(truth["inter"][2])
    assert out.profiled["scales_from"] == "intra" and Cluster.from_dict(out.to_dict()) == out
    assert _calibrated(out, [rank] * 4, plan).device.name == "cpu-profiled"  # no '-profiled-profiled'


# ------------------------------------------------------------------- the Cluster fields (pure)
def test_collective_beta_scale_is_validated_and_canonical():
    base = Cluster.local(1, 2, memory_bytes=2**30)
    scaled = dataclasses.replace(base, collective_beta_scale={"all_gather": 3, "Reduce-Scatter": 2.5})
    assert scaled.collective_beta_scale == {"allgather": 3.0, "reducescatter": 2.5}
    assert scaled.beta_scale("all_gather") == 3.0 and scaled.beta_scale("alltoall") == 1.0
    assert hash(scaled) == hash(base) and scaled != base and "allgather 3" in scaled.describe()
    for bad in ({"allgather": 0}, {"allgather": -1.0}, {"allgather": math.inf}, {"allgathr": 2.0},
                {"allgather": 2.0, "all_gather": 2.0}, [("allgather", 2.0)]):
        with pytest.raises(ClusterSpecError, match="collective_beta_scale"):
            dataclasses.replace(base, collective_beta_scale=bad)


def test_profiled_must_be_plain_json():
    base = Cluster.local(1, 2, memory_bytes=2**30)
    for bad in ({"sizes": (1, 2)}, {1: "x"}, {"x": object()}, {"x": math.nan}, "yes"):
        with pytest.raises(ClusterSpecError, match="profiled"):
            dataclasses.replace(base, profiled=bad)


def test_scales_and_profiled_round_trip(tmp_path):
    cluster = dataclasses.replace(
        Cluster.simulated(2, 8), collective_beta_scale={"allgather": 3.25, "p2p": 0.5},
        profiled={"date": "2025-01-02T03:04:05+00:00", "fits": {"allreduce": {"alpha_s": 1.5e-05, "x": [1, 2.5]}}})
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    cluster.to_json(tmp_path / "c.json")
    assert Cluster.from_json(tmp_path / "c.json") == cluster
    cluster.to_yaml(tmp_path / "c.yaml")
    assert Cluster.from_yaml(tmp_path / "c.yaml") == cluster
    assert Cluster.from_dict(Cluster.simulated(2, 8).to_dict()).collective_beta_scale == {}


def test_profile_cluster_rejects_bad_arguments():
    with pytest.raises(ValueError, match="sizes_bytes"):
        profile_cluster(Cluster.local(1, 2), sizes_bytes=(4096,))
    with pytest.raises(ValueError, match="repeats"):
        profile_cluster(Cluster.local(1, 2), repeats=0)


# ------------------------------------------------------------------ a real profile (Ray workers)
def _check_profiled(cluster: Cluster) -> None:
    link = cluster.intra_host_link
    assert link.name.endswith("-profiled") and 1e-6 <= link.alpha_s <= 0.1
    assert 10e6 <= link.bandwidth_bytes_per_s <= 100e9
    for fit in cluster.profiled["links"]["intra"]["fits"].values():
        assert all(math.isfinite(v) and v >= 0 for v in (fit["alpha_s"], fit["beta_s_per_byte"]))
        assert fit["beta_s_per_byte"] > 0
    scales = cluster.collective_beta_scale
    assert set(scales) == {"allgather", "reducescatter", "alltoall", "p2p"}
    assert all(math.isfinite(s) and s > 0 for s in scales.values())
    device = cluster.device
    assert device.name == "cpu-profiled" and device.compute_efficiency == 1.0
    assert all(1e8 <= f <= 1e13 for f in device.peak_flops.values()) and "float32" in device.peak_flops
    assert 1e8 <= device.memory_bandwidth_bytes_per_s <= 1e12


def test_profile_local_1x2(ray_session, tmp_path):
    base = Cluster.local(1, 2)
    profiled = profile_cluster(base, sizes_bytes=(4 * _KiB, 256 * _KiB, 8 * _MiB), repeats=3, matmul_sizes=(128, 256),
                            copy_bytes=16 * _MiB)
    _check_profiled(profiled)
    assert profiled.inter_host_link == base.inter_host_link  # one host: nothing to measure between hosts
    assert profiled.device.memory_bytes == base.device.memory_bytes and profiled.profiled["date"]
    profiled.to_json(tmp_path / "profiled.json")
    assert Cluster.from_json(tmp_path / "profiled.json") == profiled

    mesh = cm.MeshCost.from_cluster(profiled, (1, 2), (1, 2))
    scale = profiled.collective_beta_scale["allgather"]
    assert mesh.allgather_beta_scale == scale
    assert mesh.reducescatter_beta_scale == profiled.collective_beta_scale["reducescatter"]
    link, b = profiled.intra_host_link, 8 * _MiB
    assert cm.allgather_s(mesh, 1, b) == pytest.approx(link.alpha_s + link.beta_s_per_byte * scale * b / 2)
    assert mesh.peak_flops_per_s == profiled.device.flops_per_s("float32") and mesh.compute_efficiency == 1.0


@pytest.mark.sweep
def test_profile_local_2x2_measures_both_links(ray_session):
    """Two 'hosts' of two devices: intra and inter groups both measured (4 workers: slow on 2 cores)."""
    profiled = profile_cluster(Cluster.local(2, 2), sizes_bytes=(4 * _KiB, 256 * _KiB, 8 * _MiB), repeats=3,
                                           matmul_sizes=(128, 256), copy_bytes=16 * _MiB)
    _check_profiled(profiled)
    inter = profiled.inter_host_link
    assert inter.name.endswith("-profiled") and 1e-6 <= inter.alpha_s <= 0.1
    assert set(profiled.profiled["links"]) == {"intra", "inter"}


def test_calibration_prices_busy_rates_operator_overheads_and_busy_links():
    """With the all-busy measurements the device gets the sustained rates and the operator
    overheads (median over ranks), the links the collectives timed between operators; the
    best-of rates and the idle fits stay in ``profiled``."""
    cluster, sizes = Cluster.local(1, 2, memory_bytes=2**30), (4 * _KiB, 1 * _MiB, 16 * _MiB)

    def times(alpha, beta):
        return {c: {str(b): alpha + beta * regressor_bytes(c, _chunk_elems(b, 2) * 2 * 4, 2) for b in sizes}
                for c in COLLECTIVES}

    ranks = [{"matmul_flops_per_s": {"float32": {"256": 8e10, "512": 1e11}}, "memory_bandwidth_bytes_per_s": 2e10,
              "busy_matmul_flops_per_s": {"float32": f}, "busy_memory_bandwidth_bytes_per_s": 8e9,
              "op_overhead_s": {"local": 5e-6, "sharded": o}, "links": {"intra": times(3e-4, 7e-10)},
              "busy_links": {"intra": times(2e-3, 9e-10)}} for f, o in ((4e10, 3e-5), (5e10, 5e-5))]
    plan = _Plan(sizes_bytes=sizes, repeats=3, matmul_sizes=None, copy_bytes=None, groups=link_groups(cluster),
                 busy_window_s=0.1)
    out = _calibrated(cluster, ranks, plan)
    assert out.device.peak_flops == {"float32": 4.5e10} and out.device.memory_bandwidth_bytes_per_s == 8e9
    assert out.device.op_overhead_s == pytest.approx(5e-6) and out.device.sharded_op_overhead_s == pytest.approx(4e-5)
    assert out.intra_host_link.alpha_s == pytest.approx(2e-3)
    assert out.intra_host_link.beta_s_per_byte == pytest.approx(9e-10)
    assert out.profiled["best_flops_per_s"] == {"float32": 1e11}
    assert out.profiled["idle_links"]["intra"]["fits"]["allreduce"]["alpha_s"] == pytest.approx(3e-4)
    assert Cluster.from_dict(out.to_dict()) == out
    mesh = cm.MeshCost.from_cluster(out, (1, 2), (2, 1))
    assert mesh.op_overhead_s == pytest.approx(4e-5) and mesh.peak_flops_per_s == 4.5e10


def test_operator_overheads_are_validated_and_default_to_a_kernel_launch():
    from alpa_torch.core.cluster import DEVICE_SPECS, DeviceSpec

    assert DEVICE_SPECS["a100-80gb"].op_overhead_s == DEVICE_SPECS["a100-80gb"].sharded_op_overhead_s == 5e-6
    cpu = DEVICE_SPECS["cpu"]
    assert cpu.sharded_op_overhead_s > cpu.op_overhead_s > 0  # the replay's bookkeeping on top of a plain call
    for bad in (-1e-6, math.inf, "1us"):
        with pytest.raises(ClusterSpecError, match="op_overhead_s"):
            DeviceSpec(name="x", peak_flops={"float32": 1e12}, memory_bandwidth_bytes_per_s=1e11,
                       memory_bytes=1e9, op_overhead_s=bad)
    old = Cluster.local(1, 2).to_dict()
    del old["device"]["op_overhead_s"], old["device"]["sharded_op_overhead_s"]
    old["device"]["name"] = "cpu-profiled"  # a cluster JSON written before these fields existed
    assert Cluster.from_dict(old).device.op_overhead_s == 5e-6
