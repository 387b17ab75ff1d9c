"""Tests of alpa_torch.core.cluster: specs, validation, serialisation, Ray discovery, submeshes.

Submesh and logical-mesh expectations are written out by hand for the named
clusters, then checked against an independent closed form for every N x M with
N, M in 1..8. Ray is never started: ``ray.nodes()`` is monkeypatched.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle

import pytest

from alpa_torch.core.cluster import DEVICE_SPECS, LINK_SPECS, Cluster, DeviceSpec, LinkSpec
from alpa_torch.core.errors import ClusterSpecError
from runtime.discovery import builtin_device_for_cuda, cluster_from_ray

TERA = 1e12


# ----------------------------------------------------------------------------- specs
def test_builtin_device_datasheet_numbers():
    names = ("v100-16gb", "a100-40gb", "a100-80gb", "h100-80gb", "b200")
    v100, a40, a80, h100, b200 = (DEVICE_SPECS[k] for k in names)
    assert v100.peak_flops == {"float32": 15.7 * TERA, "float16": 125 * TERA}
    assert v100.memory_bandwidth_bytes_per_s == 900e9
    assert a40.peak_flops["float32"] == 19.5 * TERA and a40.peak_flops["bfloat16"] == 312 * TERA
    assert a40.peak_flops["tfloat32"] == 156 * TERA
    assert a40.memory_bandwidth_bytes_per_s == 1555e9 and a80.memory_bandwidth_bytes_per_s == 2039e9
    assert a40.memory_bytes == 40 * 2**30 and a80.memory_bytes == 80 * 2**30
    assert h100.peak_flops["bfloat16"] == 989 * TERA and h100.peak_flops["float32"] == 67 * TERA
    assert h100.memory_bandwidth_bytes_per_s == 3.35e12
    assert b200.peak_flops["bfloat16"] == 2250 * TERA and b200.peak_flops["float32"] == 80 * TERA
    assert b200.memory_bandwidth_bytes_per_s == 8e12 and b200.memory_bytes == 180e9
    assert all(DEVICE_SPECS[k].compute_efficiency == 0.6 for k in DEVICE_SPECS if k != "cpu")
    cpu = DEVICE_SPECS["cpu"]
    assert cpu.compute_efficiency == 1.0 and cpu.peak_flops == {"float32": 50e9}
    assert cpu.memory_bandwidth_bytes_per_s == 10e9
    assert set(DEVICE_SPECS) == {"cpu", "v100-16gb", "a100-40gb", "a100-80gb", "h100-80gb", "b200"}
    assert all(spec.name == key for key, spec in DEVICE_SPECS.items())


def test_flops_per_s_is_the_peak_and_falls_back_to_float32():
    a100 = DEVICE_SPECS["a100-80gb"]
    assert a100.flops_per_s("bfloat16") == 312 * TERA
    assert a100.flops_per_s("torch.float16") == 312 * TERA
    assert a100.flops_per_s() == 19.5 * TERA
    assert a100.flops_per_s("float64") == 19.5 * TERA
    assert a100.effective_flops_per_s("bfloat16") == pytest.approx(0.6 * 312 * TERA)
    assert DEVICE_SPECS["v100-16gb"].flops_per_s("bfloat16") == 15.7 * TERA  # no bf16 tensor cores on V100


def test_builtin_links():
    expected_bw = {"nvlink2": 150e9, "nvlink3": 300e9, "nvlink4": 450e9, "nvlink5": 900e9, "pcie4": 25e9,
                   "ib-200g": 25e9, "ib-400g": 50e9, "eth-25g": 3.125e9, "eth-100g": 12.5e9, "gloo-local": 1.4e9}
    assert {k: v.bandwidth_bytes_per_s for k, v in LINK_SPECS.items()} == expected_bw
    assert LINK_SPECS["gloo-local"].alpha_s == pytest.approx(0.3e-3)
    for name in ("nvlink2", "nvlink3", "nvlink4", "nvlink5"):
        assert 5e-6 <= LINK_SPECS[name].alpha_s <= 10e-6
    for name in ("ib-200g", "ib-400g"):
        assert 15e-6 <= LINK_SPECS[name].alpha_s <= 20e-6
    assert LINK_SPECS["eth-25g"].alpha_s == 50e-6
    assert LINK_SPECS["ib-200g"].beta_s_per_byte == pytest.approx(1 / 25e9)
    assert all(spec.name == key for key, spec in LINK_SPECS.items())


def test_device_spec_owns_a_copy_of_peak_flops():
    flops = {"float32": 1e12}
    spec = DeviceSpec(name="x", peak_flops=flops, memory_bandwidth_bytes_per_s=1e9, memory_bytes=1e9)
    flops["float32"] = -1.0
    assert spec.peak_flops == {"float32": 1e12}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "y"  # type: ignore[misc]


# ------------------------------------------------------------------------ validation
def _device(**overrides):
    fields = dict(name="gpu", peak_flops={"float32": 1e12}, memory_bandwidth_bytes_per_s=1e12, memory_bytes=1e10)
    return DeviceSpec(**(fields | overrides))


@pytest.mark.parametrize(("overrides", "words"), [
    ({"peak_flops": {"float32": -1.0}}, ["peak_flops['float32']", "-1.0", "Fix"]),
    ({"peak_flops": {"float32": 1e12, "bfloat16": 0}}, ["peak_flops['bfloat16']", "0", "> 0"]),
    ({"peak_flops": {"bfloat16": 1e12}}, ["peak_flops", "'float32'", "Fix"]),
    ({"memory_bytes": 0}, ["memory_bytes", "= 0", "Fix"]),
    ({"memory_bandwidth_bytes_per_s": -5.0}, ["memory_bandwidth_bytes_per_s", "-5.0", "bytes/s"]),
    ({"memory_bandwidth_bytes_per_s": float("inf")}, ["memory_bandwidth_bytes_per_s", "inf"]),
    ({"compute_efficiency": 1.5}, ["compute_efficiency", "1.5", "(0, 1]"]),
    ({"name": ""}, ["DeviceSpec.name", "non-empty"]),
])
def test_invalid_device_spec(overrides, words):
    with pytest.raises(ClusterSpecError) as info:
        _device(**overrides)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"alpha_s": -1e-6, "bandwidth_bytes_per_s": 1e9}, ["alpha_s", "-1e-06", ">= 0", "Fix"]),
    ({"alpha_s": 0.0, "bandwidth_bytes_per_s": 0}, ["bandwidth_bytes_per_s", "= 0", "Fix"]),
    ({"alpha_s": 0.0, "bandwidth_bytes_per_s": "fast"}, ["bandwidth_bytes_per_s", "'fast'"]),
])
def test_invalid_link_spec(kwargs, words):
    with pytest.raises(ClusterSpecError) as info:
        LinkSpec(name="l", **kwargs)
    for word in words + ["LinkSpec('l')"]:
        assert word in str(info.value)


@pytest.mark.parametrize(("overrides", "words"), [
    ({"num_hosts": 0}, ["num_hosts", "= 0", "integer >= 1", "machines"]),
    ({"num_hosts": -2}, ["num_hosts", "-2"]),
    ({"num_hosts": True}, ["num_hosts", "True"]),
    ({"num_hosts": 2.0}, ["num_hosts", "2.0"]),
    ({"devices_per_host": 0}, ["devices_per_host", "= 0", "per machine"]),
    ({"threads_per_device": 0}, ["threads_per_device", "= 0"]),
    ({"backend": "mpi"}, ["backend", "'mpi'", "'gloo'", "'nccl'"]),
    ({"device": "a100-80gb"}, ["device", "DeviceSpec", "from_dict"]),
    ({"is_local": True, "backend": "nccl"}, ["backend", "gloo"]),
])
def test_invalid_cluster(overrides, words):
    base = Cluster.simulated(2, 8)
    with pytest.raises(ClusterSpecError) as info:
        dataclasses.replace(base, **overrides)
    for word in words:
        assert word in str(info.value)


def test_invalid_cluster_via_constructors():
    with pytest.raises(ClusterSpecError, match="num_hosts = 0"):
        Cluster.local(0, 2)
    with pytest.raises(ClusterSpecError, match="devices_per_host = -1"):
        Cluster.local(2, -1)
    with pytest.raises(ClusterSpecError, match="devices_per_host = 0"):
        Cluster.simulated(1, 0)
    with pytest.raises(ClusterSpecError, match="num_hosts = '2'"):
        Cluster.local("2", 2)  # type: ignore[arg-type]
    with pytest.raises(ClusterSpecError, match="threads_per_device = 0"):
        Cluster.local(1, 2, threads_per_device=0)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ClusterSpecError) as info:
        Cluster.simulated(1, 8, device="a100")
    assert "'a100'" in str(info.value)
    for known in DEVICE_SPECS:
        assert known in str(info.value)
    with pytest.raises(ClusterSpecError) as info:
        Cluster.simulated(1, 8, inter="infiniband")
    assert "'infiniband'" in str(info.value) and "ib-200g" in str(info.value) and "gloo-local" in str(info.value)


def test_cluster_is_hashable_picklable_and_counts_devices():
    cluster = Cluster.simulated(4, 8, device="h100-80gb", intra="nvlink4", inter="ib-400g")
    assert cluster.num_devices == 32
    assert hash(cluster) == hash(Cluster.simulated(4, 8, device="h100-80gb", intra="nvlink4", inter="ib-400g"))
    assert pickle.loads(pickle.dumps(cluster)) == cluster
    assert cluster.backend == "nccl" and not cluster.is_local


# ----------------------------------------------------------------------- constructors
def test_local_cluster():
    cluster = Cluster.local(2, 4, memory_bytes=2**30, threads_per_device=2)
    assert (cluster.num_hosts, cluster.devices_per_host, cluster.num_devices) == (2, 4, 8)
    assert cluster.is_local and cluster.backend == "gloo" and cluster.threads_per_device == 2
    assert cluster.device.name == "cpu" and cluster.device.memory_bytes == 2**30
    assert cluster.device.flops_per_s() == 2 * DEVICE_SPECS["cpu"].flops_per_s()
    assert cluster.intra_host_link == cluster.inter_host_link == LINK_SPECS["gloo-local"]


def test_local_cluster_default_memory_splits_host_ram():
    import os

    host_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert Cluster.local(2, 3).device.memory_bytes == host_ram // 6
    assert Cluster.local(1, 1).device.memory_bytes == host_ram


def test_describe_is_short_and_informative():
    text = Cluster.simulated(2, 8).describe()
    for word in ("2x8", "16 x a100-80gb", "312 TFLOP/s bfloat16", "80.0 GiB", "nvlink3 300 GB/s",
                 "ib-200g 25 GB/s", "nccl"):
        assert word in text
    assert "\n" not in text and len(text) < 300
    assert "local" in Cluster.local(1, 2, memory_bytes=2**30).describe()


# ---------------------------------------------------------------------- serialisation
def _custom_cluster():
    device = DeviceSpec(name="my-gpu", peak_flops={"float32": 1.5e13, "bfloat16": 2.5e14},
                        memory_bandwidth_bytes_per_s=1.2e12, memory_bytes=24 * 2**30, compute_efficiency=0.55)
    link = LinkSpec(name="my-net", alpha_s=1.7e-5, bandwidth_bytes_per_s=1.1e10)
    return Cluster(num_hosts=3, devices_per_host=4, device=device, intra_host_link=LINK_SPECS["pcie4"],
                   inter_host_link=link, backend="nccl")


@pytest.mark.parametrize("make", [
    lambda: Cluster.simulated(2, 8),
    lambda: Cluster.local(2, 2, memory_bytes=123456789, threads_per_device=3),
    _custom_cluster,
])
def test_dict_json_yaml_round_trip(make, tmp_path):
    cluster = make()
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    cluster.to_json(tmp_path / "c.json")
    loaded = Cluster.from_json(tmp_path / "c.json")
    assert loaded == cluster and loaded.to_dict() == cluster.to_dict()
    loaded.to_json(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == (tmp_path / "c.json").read_text()
    cluster.to_yaml(tmp_path / "c.yaml")
    assert Cluster.from_yaml(tmp_path / "c.yaml") == cluster


def test_to_dict_is_plain_json():
    data = json.loads(json.dumps(Cluster.simulated(1, 2).to_dict()))
    assert data["device"]["name"] == "a100-80gb" and data["inter_host_link"]["name"] == "ib-200g"
    assert data["backend"] == "nccl" and data["num_hosts"] == 1


def test_from_dict_names_and_partial_overrides():
    cluster = Cluster.from_dict({"num_hosts": 2, "devices_per_host": 8, "device": "h100-80gb",
                                 "intra_host_link": "nvlink4", "inter_host_link": {"name": "ib-400g", "alpha_s": 1e-5}})
    assert cluster.device == DEVICE_SPECS["h100-80gb"] and cluster.backend == "nccl"
    assert cluster.inter_host_link == LinkSpec(name="ib-400g", alpha_s=1e-5, bandwidth_bytes_per_s=50e9)
    cpu = Cluster.from_dict({"num_hosts": 1, "devices_per_host": 2, "device": {"name": "cpu", "memory_bytes": 1e9},
                             "intra_host_link": "gloo-local", "inter_host_link": "gloo-local"})
    assert cpu.backend == "gloo" and cpu.device.memory_bytes == 1e9


@pytest.mark.parametrize(("data", "words"), [
    ({"num_hosts": 1}, ["lacks keys", "devices_per_host", "Fix"]),
    ({"num_hosts": 1, "devices_per_host": 1, "device": "cpu", "intra_host_link": "pcie4",
      "inter_host_link": "pcie4", "gpus": 8}, ["unknown keys", "'gpus'"]),
    ({"num_hosts": 1, "devices_per_host": 1, "device": {"name": "new", "memory_bytes": 1},
      "intra_host_link": "pcie4", "inter_host_link": "pcie4"}, ["lacks keys", "peak_flops", "built-in"]),
    ({"num_hosts": 1, "devices_per_host": 1, "device": {"name": "cpu", "tflops": 1},
      "intra_host_link": "pcie4", "inter_host_link": "pcie4"}, ["unknown keys", "'tflops'"]),
    ({"num_hosts": 1, "devices_per_host": 1, "device": 7, "intra_host_link": "pcie4",
      "inter_host_link": "pcie4"}, ["device = 7", "a100-80gb"]),
    ([1, 2], ["must be a dict", "[1, 2]"]),
])
def test_from_dict_errors(data, words):
    with pytest.raises(ClusterSpecError) as info:
        Cluster.from_dict(data)
    for word in words:
        assert word in str(info.value)


def test_from_yaml_hand_written_with_scientific_notation(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "num_hosts: 2\n"
        "devices_per_host: 4\n"
        "device:\n"
        "  name: lab-gpu\n"
        "  peak_flops: {float32: 20e12, bfloat16: 1.5e14}\n"
        "  memory_bandwidth_bytes_per_s: 1e12\n"
        "  memory_bytes: 25769803776\n"
        "intra_host_link: pcie4\n"
        "inter_host_link: {name: eth-100g, alpha_s: 4e-5}\n")
    cluster = Cluster.from_yaml(path)
    assert cluster.device.peak_flops == {"float32": 20e12, "bfloat16": 1.5e14}
    assert cluster.device.memory_bandwidth_bytes_per_s == 1e12
    assert cluster.inter_host_link.alpha_s == 4e-5 and cluster.inter_host_link.bandwidth_bytes_per_s == 12.5e9
    assert cluster.backend == "nccl" and cluster.num_devices == 8


def test_bad_files_raise_cluster_spec_error(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ClusterSpecError, match="bad.json"):
        Cluster.from_json(tmp_path / "bad.json")
    (tmp_path / "bad.yaml").write_text("a: [1, 2\n")
    with pytest.raises(ClusterSpecError, match="bad.yaml"):
        Cluster.from_yaml(tmp_path / "bad.yaml")


# ------------------------------------------------------------------------- from_ray
def _node(ip, *, alive=True, gpus=0, cpus=16, accelerator=None, memory=64 * 2**30):
    resources = {"CPU": float(cpus), "memory": float(memory), f"node:{ip}": 1.0}
    if gpus:
        resources["GPU"] = float(gpus)
    if accelerator:
        resources[f"accelerator_type:{accelerator}"] = 1.0
    return {"NodeID": f"{ip.replace('.', '')}abcdef0123", "Alive": alive, "NodeManagerAddress": ip,
            "Resources": resources}


@pytest.fixture
def fake_ray(monkeypatch):
    """Point ray.nodes() at a list the test fills; ray.init must not be reached when initialised."""
    ray = pytest.importorskip("ray")
    nodes: list[dict] = []
    calls: list[object] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: list(nodes))
    monkeypatch.setattr(ray, "init", lambda address=None, **kw: calls.append(address))
    return nodes, calls, monkeypatch, ray


def test_from_ray_two_gpu_nodes(fake_ray):
    nodes, calls, _, _ = fake_ray
    nodes += [_node("10.0.0.1", cpus=8),  # CPU-only head: skipped
              _node("10.0.0.2", gpus=8, accelerator="A100-80G"), _node("10.0.0.3", gpus=8, accelerator="A100-80G"),
              _node("10.0.0.4", alive=False, gpus=8, accelerator="H100")]
    cluster = cluster_from_ray()
    assert (cluster.num_hosts, cluster.devices_per_host) == (2, 8)
    assert cluster.device == DEVICE_SPECS["a100-80gb"] and cluster.backend == "nccl"
    assert cluster.intra_host_link.name == "nvlink3" and cluster.inter_host_link.name == "ib-200g"
    assert not cluster.is_local and calls == []


def test_from_ray_connects_when_not_initialised(fake_ray):
    nodes, calls, monkeypatch, ray = fake_ray
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    nodes.append(_node("10.0.0.2", gpus=4, accelerator="H100"))
    cluster = cluster_from_ray("ray://head:10001", inter="eth-100g")
    assert calls == ["ray://head:10001"]
    assert (cluster.num_hosts, cluster.devices_per_host, cluster.device.name) == (1, 4, "h100-80gb")
    assert cluster.intra_host_link.name == "nvlink4" and cluster.inter_host_link.name == "eth-100g"


def test_from_ray_uneven_gpu_counts_use_the_minimum(fake_ray, caplog):
    nodes = fake_ray[0]
    nodes += [_node("10.0.0.2", gpus=8, accelerator="H100"), _node("10.0.0.3", gpus=4, accelerator="H100")]
    with caplog.at_level(logging.WARNING, logger="alpa_torch.core.cluster"):
        cluster = cluster_from_ray()
    assert (cluster.num_hosts, cluster.devices_per_host) == (2, 4)
    assert "10.0.0.2" in caplog.text and "idle" in caplog.text


def test_from_ray_mixed_accelerators_name_the_nodes(fake_ray):
    nodes = fake_ray[0]
    nodes += [_node("10.0.0.2", gpus=8, accelerator="A100-80G"), _node("10.0.0.3", gpus=8, accelerator="H100")]
    with pytest.raises(ClusterSpecError) as info:
        cluster_from_ray()
    for word in ("10.0.0.2", "10.0.0.3", "A100-80G", "H100", "device="):
        assert word in str(info.value)
    assert cluster_from_ray(device="a100-80gb").device.name == "a100-80gb"  # explicit device: accepted


def test_from_ray_unknown_accelerator_asks_for_device(fake_ray):
    fake_ray[0].append(_node("10.0.0.2", gpus=2, accelerator="T4"))
    with pytest.raises(ClusterSpecError, match="'T4'.*device="):
        cluster_from_ray()
    custom = dataclasses.replace(DEVICE_SPECS["v100-16gb"], name="t4")
    cluster = cluster_from_ray(device=custom)
    assert cluster.device == custom and cluster.intra_host_link.name == "pcie4"


def test_from_ray_cpu_only(fake_ray):
    nodes = fake_ray[0]
    nodes += [_node("10.0.0.1", cpus=4, memory=8 * 2**30), _node("10.0.0.2", cpus=4, memory=16 * 2**30)]
    cluster = cluster_from_ray()
    assert (cluster.num_hosts, cluster.devices_per_host, cluster.threads_per_device) == (2, 4, 1)
    assert cluster.device.name == "cpu" and cluster.backend == "gloo"
    assert cluster.device.memory_bytes == 2 * 2**30  # smallest node's memory / devices
    assert cluster.intra_host_link.name == "gloo-local" and cluster.inter_host_link.name == "eth-25g"


def test_from_ray_big_cpu_node_caps_devices_and_adds_threads(fake_ray):
    fake_ray[0].append(_node("10.0.0.1", cpus=32))
    cluster = cluster_from_ray()
    assert (cluster.num_hosts, cluster.devices_per_host, cluster.threads_per_device) == (1, 8, 4)
    assert cluster.device.flops_per_s() == 4 * DEVICE_SPECS["cpu"].flops_per_s()


def test_from_ray_no_usable_nodes(fake_ray):
    fake_ray[0].append(_node("10.0.0.1", cpus=0))
    with pytest.raises(ClusterSpecError, match="no alive node.*ray start"):
        cluster_from_ray()


# ------------------------------------------------------------------------ submeshes
SUBMESHES = {  # hand-written, Alpa §5: (1, 2^k) with 2^k <= M, and (n, M) for n <= N
    (1, 1): [(1, 1)],
    (1, 2): [(1, 1), (1, 2)],
    (1, 4): [(1, 1), (1, 2), (1, 4)],
    (1, 8): [(1, 1), (1, 2), (1, 4), (1, 8)],
    (2, 8): [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)],
    (4, 8): [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (3, 8), (4, 8)],
    (8, 8): [(1, 1), (1, 2), (1, 4), (1, 8)] + [(n, 8) for n in range(2, 9)],
    (2, 2): [(1, 1), (1, 2), (2, 2)],
    (2, 4): [(1, 1), (1, 2), (1, 4), (2, 4)],
    (3, 2): [(1, 1), (1, 2), (2, 2), (3, 2)],
    (1, 3): [(1, 1), (1, 2), (1, 3)],
    (2, 3): [(1, 1), (1, 2), (1, 3), (2, 3)],
    (2, 6): [(1, 1), (1, 2), (1, 4), (1, 6), (2, 6)],
    (3, 1): [(1, 1), (2, 1), (3, 1)],
}


@pytest.mark.parametrize("shape", list(SUBMESHES))
def test_submesh_shapes_by_hand(shape):
    assert list(Cluster.local(*shape, memory_bytes=2**30).submesh_shapes()) == SUBMESHES[shape]


@pytest.mark.parametrize(("cluster", "submesh", "expected"), [
    ((2, 4), (2, 4), [(1, 8), (2, 4), (4, 2), (8, 1)]),
    ((2, 8), (2, 8), [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)]),
    ((2, 8), (1, 4), [(1, 4), (2, 2), (4, 1)]),
    ((1, 1), (1, 1), [(1, 1)]),
    ((3, 2), (3, 2), [(1, 6), (2, 3), (3, 2), (6, 1)]),
    ((3, 2), (1, 2), [(1, 2), (2, 1)]),
    ((8, 8), (8, 8), [(1, 64), (2, 32), (4, 16), (8, 8), (16, 4), (32, 2), (64, 1)]),
])
def test_logical_mesh_shapes_by_hand(cluster, submesh, expected):
    assert list(Cluster.simulated(*cluster).logical_mesh_shapes(submesh)) == expected


@pytest.mark.parametrize(("cluster", "submesh"), [((2, 8), (2, 2)), ((1, 8), (1, 3)), ((2, 8), (3, 8)),
                                                  ((2, 8), (0, 8)), ((2, 8), "2x8")])
def test_bad_submesh_lists_valid_ones(cluster, submesh):
    with pytest.raises(ClusterSpecError) as info:
        Cluster.simulated(*cluster).logical_mesh_shapes(submesh)
    assert repr(submesh) in str(info.value) and "(1, 8)" in str(info.value) and "Fix" in str(info.value)


INTRA, INTER = "intra", "inter"


@pytest.mark.parametrize(("cluster", "submesh", "logical", "expected"), [
    ((2, 8), (2, 8), (2, 8), (INTER, INTRA)),
    ((2, 8), (2, 8), (1, 16), (INTRA, INTER)),
    ((2, 8), (2, 8), (16, 1), (INTER, INTRA)),
    ((2, 8), (2, 8), (4, 4), (INTER, INTRA)),
    ((2, 8), (2, 8), (8, 2), (INTER, INTRA)),
    ((2, 8), (1, 8), (2, 4), (INTRA, INTRA)),
    ((2, 8), (1, 8), (8, 1), (INTRA, INTRA)),
    ((2, 4), (2, 4), (4, 2), (INTER, INTRA)),
    ((2, 4), (2, 4), (2, 4), (INTER, INTRA)),
    ((3, 2), (3, 2), (2, 3), (INTER, INTER)),  # rows {0,1,2}: device 2 is on host 1
    ((3, 2), (3, 2), (3, 2), (INTER, INTRA)),
    ((3, 2), (2, 2), (1, 4), (INTRA, INTER)),
    ((1, 1), (1, 1), (1, 1), (INTRA, INTRA)),
    ((4, 8), (4, 8), (2, 16), (INTER, INTER)),
    ((4, 8), (4, 8), (4, 8), (INTER, INTRA)),
])
def test_mesh_axis_links_by_hand(cluster, submesh, logical, expected):
    c = Cluster.simulated(*cluster, intra="nvlink3", inter="ib-200g")
    names = {INTRA: "nvlink3", INTER: "ib-200g"}
    assert tuple(link.name for link in c.mesh_axis_links(submesh, logical)) == tuple(names[e] for e in expected)


def test_mesh_axis_links_rejects_wrong_logical_shape():
    with pytest.raises(ClusterSpecError, match=r"\(3, 3\).*\(2, 8\).*\(4, 4\)"):
        Cluster.simulated(2, 8).mesh_axis_links((2, 8), (3, 3))


@pytest.mark.parametrize("num_hosts", range(1, 9))
@pytest.mark.parametrize("per_host", range(1, 9))
def test_submeshes_and_links_match_closed_form(num_hosts, per_host):
    cluster = Cluster.simulated(num_hosts, per_host, intra="nvlink3", inter="ib-200g")
    shapes = cluster.submesh_shapes()
    powers = {(1, 2**k) for k in range(4) if 2**k <= per_host}
    assert set(shapes) == powers | {(n, per_host) for n in range(1, num_hosts + 1)}
    assert len(shapes) == len(set(shapes))
    assert [a * b for a, b in shapes] == sorted(a * b for a, b in shapes)
    for n, m in shapes:
        logical = cluster.logical_mesh_shapes((n, m))
        assert [a * b for a, b in logical] == [n * m] * len(logical) and list(logical) == sorted(logical)
        assert len(logical) == sum(n * m % a == 0 for a in range(1, n * m + 1))
        for a, b in logical:
            axis0, axis1 = cluster.mesh_axis_links((n, m), (a, b))
            # Rows of b consecutive devices stay on a host iff b divides m; columns span hosts unless a == 1.
            assert (axis0.name == "nvlink3") == (n == 1 or a == 1)
            assert (axis1.name == "nvlink3") == (n == 1 or m % b == 0)


def test_submesh_device_ids():
    c = Cluster.simulated(4, 8)
    assert c.submesh_device_ids((1, 4), 4) == (4, 5, 6, 7)
    assert c.submesh_device_ids((1, 2), 13) == (13, 14)
    assert c.submesh_device_ids((1, 8), 8) == tuple(range(8, 16))
    assert c.submesh_device_ids((2, 8), 16) == tuple(range(16, 32))
    assert c.submesh_device_ids((4, 8), 0) == tuple(range(32))
    assert Cluster.simulated(3, 2).submesh_device_ids((2, 2), 2) == (2, 3, 4, 5)


@pytest.mark.parametrize(("submesh", "offset"), [((1, 4), 6), ((2, 8), 4), ((2, 8), 24), ((1, 1), 32),
                                                 ((1, 1), -1), ((1, 2), 1.0), ((2, 2), 0)])
def test_submesh_device_ids_rejects_bad_placement(submesh, offset):
    with pytest.raises(ClusterSpecError) as info:
        Cluster.simulated(4, 8).submesh_device_ids(submesh, offset)
    assert "Fix" in str(info.value) and repr(submesh) in str(info.value)


@pytest.mark.parametrize("name, spec", [
    ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H200", "h100-80gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("Tesla V100-SXM2-16GB", "v100-16gb"), ("NVIDIA L4", None)])
def test_a_cuda_device_name_maps_to_its_builtin_spec(name, spec):
    assert builtin_device_for_cuda(name) == spec
    assert spec is None or spec in DEVICE_SPECS
