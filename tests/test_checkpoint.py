"""Checkpoints: tiles assemble back into tensors, commits are atomic, bad files are refused,
and training resumed from a checkpoint (on another plan and cluster size, or on a plain
model) gives the losses of a run that never stopped.

The format tests write shard files in-process with hand-made tiles (what two
devices of a row-sharded plan would write), so they need no workers. The
end-to-end test shares the session's Ray.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pickle

import pytest
import torch

from alpa_torch import CheckpointError, Cluster, load_checkpoint, load_into, parallelize
from alpa_torch.core.cluster import LinkSpec
from alpa_torch.zoo import ZOO, make_batch, make_optimizer, train_step
from runtime import checkpoint as ckpt

ATOL = 1e-5


# ---------------------------------------------------------------- format (no workers)
def _plain_state(step: int = 3):
    """A Linear(3 -> 5) trained ``step`` Adam steps: its tensors and manifest metadata."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(step):
        opt.zero_grad()
        model(torch.randn(4, 3)).square().mean().backward()
        opt.step()
    values, tensors = {}, {}
    for name, p in model.named_parameters():
        values[name] = p.detach().clone()
        tensors[name] = {"kind": "param", "shape": list(p.shape), "dtype": "float32"}
        for key, v in opt.state[p].items():  # torch.optim's own state: step, exp_avg, exp_avg_sq
            values[f"{name}.{key}"] = v.clone()
            tensors[f"{name}.{key}"] = {"kind": "opt_state", "shape": list(v.shape), "dtype": "float32",
                                        "param": name, "key": key}
    meta = {"step": step, "graph_fingerprint": "0" * 16, "plan": {}, "tensors": tensors,
            "optimizer": ckpt.describe_optimizer(opt, [n for n, _ in model.named_parameters()])}
    return model, opt, values, meta


def _two_device_writer(values):
    """What a 2-device plan writes: weights and exp_avg split by rows unevenly (3 + 2), the
    rest replicated (device 0 only)."""
    def write(directory):
        files = []
        for rank, rows in ((0, slice(0, 3)), (1, slice(3, 5))):
            tiles = {}
            for name, v in values.items():
                if v.dim() == 2 and not name.endswith("exp_avg_sq"):
                    tiles[name] = (v[rows].clone(), [[rows.start, rows.stop], [0, v.shape[1]]])
                elif rank == 0:
                    tiles[name] = (v.clone(), [[0, n] for n in v.shape])
            files.append(ckpt.write_shard_file(directory, rank, tiles))
        return files
    return write


def test_tiles_assemble_into_the_saved_tensors(tmp_path):
    model, opt, values, meta = _plain_state()
    path = ckpt.save_checkpoint(tmp_path / "ck", _two_device_writer(values), meta)
    assert sorted(os.listdir(path)) == ["manifest.json", "rank0.safetensors", "rank1.safetensors"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["files"][1]["tiles"] == {"weight": [[3, 5], [0, 3]], "weight.exp_avg": [[3, 5], [0, 3]]}
    got = ckpt.assemble(*ckpt.read_manifest(path))
    for name, v in values.items():
        torch.testing.assert_close(got[name], v, atol=0, rtol=0, msg=name)


def test_load_into_a_plain_model_continues_like_the_original(tmp_path):
    model, opt, values, meta = _plain_state()
    ckpt.save_checkpoint(tmp_path / "ck", _two_device_writer(values), meta)
    fresh = torch.nn.Linear(3, 5)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    assert load_into(fresh, fresh_opt, tmp_path / "ck") == 3
    x = torch.randn(4, 3)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    torch.testing.assert_close(fresh.weight, model.weight, atol=0, rtol=0)
    model_sd, opt_sd = load_checkpoint(tmp_path / "ck")
    assert set(model_sd) == {"weight", "bias"} and float(opt_sd["state"][0]["step"]) == 3


def test_interrupted_save_keeps_the_last_good_checkpoint(tmp_path):
    _, _, values, meta = _plain_state()
    target = tmp_path / "ck"
    ckpt.save_checkpoint(target, _two_device_writer(values), meta)

    def crash(directory):
        _two_device_writer({k: v + 1 for k, v in values.items()})(directory)
        raise KeyboardInterrupt  # killed after the shards, before the manifest

    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(target, crash, dict(meta, step=4))
    assert sorted(os.listdir(tmp_path)) == ["ck"], "the temporary directory is removed"
    path, manifest = ckpt.read_manifest(target)
    assert manifest["step"] == 3
    torch.testing.assert_close(ckpt.assemble(path, manifest)["weight"], values["weight"])
    # A crash between the two renames of a commit leaves only ck.old-*: load finds it.
    os.rename(target, tmp_path / "ck.old-1234")
    assert ckpt.read_manifest(target)[1]["step"] == 3
    ckpt.save_checkpoint(target, _two_device_writer(values), dict(meta, step=5))
    assert sorted(os.listdir(tmp_path)) == ["ck"] and ckpt.read_manifest(target)[1]["step"] == 5


def _saved(tmp_path):
    _, _, values, meta = _plain_state()
    path = ckpt.save_checkpoint(tmp_path / "ck", _two_device_writer(values), meta)
    return path, json.loads((path / "manifest.json").read_text())


def test_manifest_naming_a_pickle_is_refused(tmp_path):
    path, manifest = _saved(tmp_path)
    (path / "model.pkl").write_bytes(pickle.dumps({"weight": torch.zeros(5, 3)}))
    manifest["files"][0]["file"] = "model.pkl"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"'model.pkl'.*never unpickles"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="never unpickles"):
        parallelize(train_step, cluster=Cluster.local(1, 1)).load(str(path))


def test_a_shard_whose_header_length_starts_with_0x80_is_not_taken_for_a_pickle(tmp_path):
    """safetensors opens with its header's length (8 bytes, little-endian): its first byte is 0x80
    for one header size in 256, and such a shard loaded as "a pickle" before."""
    for name_len in range(1, 300):
        entry = ckpt.write_shard_file(tmp_path, 0, {"w" * name_len: (torch.zeros(2), [[0, 2]])})
        if (tmp_path / entry["file"]).read_bytes()[:1] == b"\x80":
            break
    else:
        pytest.fail("no header length with first byte 0x80 in the range tried")
    with ckpt.open_checked(tmp_path, entry) as f:
        assert torch.equal(f.get_tensor("w" * name_len), torch.zeros(2))


def test_shard_file_replaced_by_a_pickle_is_refused(tmp_path):
    path, _ = _saved(tmp_path)
    (path / "rank1.safetensors").write_bytes(pickle.dumps({"weight": torch.zeros(2, 3)}))
    with pytest.raises(CheckpointError, match="is a pickle"):
        load_checkpoint(path)


@pytest.mark.parametrize("edit,message", [
    (lambda m: m.update(code="import os"), r"unexpected keys \['code'\]"),
    (lambda m: m["tensors"]["weight"].update(loader="pickle"), r"unexpected keys \['loader'\]"),
    (lambda m: m.update(format_version=99), "version 99"),
    (lambda m: m["files"][0]["tiles"].update(bias=[[0, 9]]), "not a box inside"),
    (lambda m: m["files"][1].update(sha256="0" * 64), "truncated or changed"),
    (lambda m: m["files"].pop(1), "incomplete"),
    (lambda m: m["tensors"]["bias"].update(dtype="object"), "dtype 'object'"),
])
def test_edited_manifest_is_refused(tmp_path, edit, message):
    path, manifest = _saved(tmp_path)
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)


def test_missing_or_non_json_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint.*manifest.json"):
        load_checkpoint(tmp_path / "nothing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(CheckpointError, match="not JSON"):
        load_checkpoint(tmp_path / "bad")


def test_checkpoint_of_another_model_is_refused(tmp_path):
    path, _ = _saved(tmp_path)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_into(torch.nn.Linear(3, 4), None, path)


# ---------------------------------------------------------------- end to end (workers)
def _sharding_cluster():
    """Cluster.local(1, 2) priced with free communication and slow compute, so the planner
    shards weights and optimizer state across the two devices (tensor parallel)."""
    base = Cluster.local(1, 2)
    free = LinkSpec(name="free", alpha_s=1e-9, bandwidth_bytes_per_s=1e15)
    return dataclasses.replace(base, intra_host_link=free, inter_host_link=free,
                               device=dataclasses.replace(base.device, peak_flops={"float32": 1e6}))


@pytest.mark.usefixtures("ray_session")
@pytest.mark.slow
def test_resume_on_another_plan_and_cluster_size_equals_a_straight_run(tmp_path):
    """4 steps straight (sharded on 2 devices, saved after step 2) == 2 steps, save, load on 1
    device, 2 more == a plain model loaded from the checkpoint == eager."""
    eager, _ = ZOO["mlp"]()
    eager_opt = make_optimizer("adamw", eager)
    batches = [make_batch("mlp", 8, seed=i) for i in range(4)]
    expected = [float(train_step(eager, eager_opt, b).detach()) for b in batches]

    model = copy.deepcopy(ZOO["mlp"]()[0])
    optimizer = make_optimizer("adamw", model)
    straight = parallelize(train_step, cluster=_sharding_cluster(), pipeline=False, plan_cache=False)
    try:
        losses = [float(straight(model, optimizer, b)) for b in batches[:2]]
        sharded = [n for n, s in straight.plan.stages[0].sharding.value_specs.items() if not s.is_replicated]
        assert sharded, "the free-communication cluster should shard some state"
        straight.save(str(tmp_path / "ck"))
        losses += [float(straight(model, optimizer, b)) for b in batches[2:]]
    finally:
        straight.shutdown()
    assert losses == pytest.approx(expected, abs=ATOL)
    assert len(os.listdir(tmp_path / "ck")) == 3, "manifest + one shard file per device"

    fresh = ZOO["mlp"]()[0]
    fresh_opt = make_optimizer("adamw", fresh)
    resumed = parallelize(train_step, cluster=Cluster.local(1, 1), plan_cache=False)
    try:
        assert resumed.load(str(tmp_path / "ck")) == 2
        tail = [float(resumed(fresh, fresh_opt, b)) for b in batches[2:]]
        state = resumed.state_dict()
    finally:
        resumed.shutdown()
    assert tail == pytest.approx(losses[2:], abs=ATOL) and state["step"] == 4
    for name, p in eager.named_parameters():
        torch.testing.assert_close(state["model"][name], p.detach(), atol=ATOL, rtol=0, msg=name)

    plain = ZOO["mlp"]()[0]
    plain_opt = make_optimizer("adamw", plain)
    assert load_into(plain, plain_opt, tmp_path / "ck") == 2
    plain_tail = [float(train_step(plain, plain_opt, b).detach()) for b in batches[2:]]
    assert plain_tail == pytest.approx(expected[2:], abs=ATOL)
