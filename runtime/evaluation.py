"""A forward-only program (an evaluation) deployed on the workers, beside the training step's.

``EvalEngine`` is the driver's side; the worker's side keeps, under ``state['evals'][key]``,
a ``StageRunner`` of the forward graph on a mesh of every rank (``interpreter.py``; it
never writes its state, and donates none of it). The state it reads comes one of three
ways (``setup['state']``):

- ``'alias'``: the training plan is one stage on the same mesh and the evaluation keeps
  each parameter where training keeps it: the runner reads the training runner's own
  tensors, no copy, no transfer;
- ``'moved'``: the training plan stores the state elsewhere (a pipeline's stages, other
  specs): each tile comes from the ranks that hold it (``state_moves.move``), once after
  each training step or state load (``state['state_version']``, which ``engine.py``
  counts), and the copies are dropped when the next training step starts;
- ``'own'``: no training step on these workers (``parallelize(fn)`` on a forward-only
  function): the runner loads the state from sources, as a training deployment does.

Each call runs the program on the whole batch (its split is the plan's) and returns the
outputs whole, from rank 0.
"""

from __future__ import annotations

import logging
import pickle

from alpa_torch.core.sharding import StageSharding

from .group import WorkerGroup
from .program import graph_bytes
from .resharding import MeshPlacement
from .state_moves import Move

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- worker side


def _install_eval(state: dict, key: str, records_bytes: bytes, setup: dict) -> bool:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    import alpa_torch.core.grad_op  # noqa: F401 - registers the alpa.grad operator a graph may call

    from .interpreter import StageRunner

    if setup["state"] == "alias":
        mesh = state["runner"].mesh
    else:
        mesh = DeviceMesh(state["device"].type, torch.arange(state["world_size"]).view(*setup["shape"]))
    runner = StageRunner(pickle.loads(records_bytes), setup["value_specs"], setup["input_specs"], setup["io"], mesh,
                         seed=setup["seed"], donate_state=False)
    state.setdefault("evals", {})[key] = {"runner": runner, "setup": setup, "version": None}
    return True


def _load_eval(state: dict, key: str, sources: list, metas: dict) -> bool:
    state["evals"][key]["runner"].load_from(sources, metas)
    return True


def _run_eval(state: dict, key: str, batch: dict):
    ev = state["evals"][key]
    runner, setup = ev["runner"], ev["setup"]
    if setup["state"] != "own" and ev["version"] != state.get("state_version", 0):
        _refresh(state, ev)
    outs = runner.evaluate(batch)
    return outs if state["rank"] == 0 else None


def _refresh(state: dict, ev: dict) -> None:
    """The evaluation's state from the training runner's, as it is now (module docstring)."""
    runner, setup = ev["runner"], ev["setup"]
    train = state["runner"]
    nodes = {name: node for kind, name, node in runner.inputs if kind in ("param", "buffer")}
    if setup["state"] == "alias":
        values = {name: train.state[name] for name in nodes}
    else:
        from .state_moves import as_dtensor, move

        held = {name: train.state[name] for name in nodes if train.has_state(name)}
        dtypes = {m.name: setup["dtypes"][m.name] for m in setup["moves"]}
        tiles = move(setup["moves"], held, runner.device, dtypes)
        values = {name: tile if runner.local else as_dtensor(tile, setup["shapes"][name], setup["specs"][name],
                                                            runner.mesh) for name, tile in tiles.items()}
    for name, value in values.items():
        runner._put_state(name, nodes[name], value)
    ev["version"] = state.get("state_version", 0)


def drop_copies(state: dict) -> None:
    """Before a training step: the evaluations let go of the state they read (it is about to change)."""
    for ev in state.get("evals", {}).values():
        if ev["setup"]["state"] != "own":
            ev["runner"].drop_state()
            ev["version"] = None


# ---------------------------------------------------------------- driver side


class EvalEngine:
    """A forward-only graph deployed on every worker of ``group`` (module docstring).

    ``sharding``: its plan on a mesh of every rank; ``source``: where its state comes from:
    'own', 'alias' (a one-stage training ``sharding`` with the same placements), or the
    training deployment's stages as ``(ranks, mesh_shape, value_specs by state name)``
    triples for 'moved'."""

    def __init__(self, group: WorkerGroup, graph, sharding: StageSharding, key: str, state: str, *,
                 train_stages: list[tuple] | None = None, seed: int = 0):
        self.group, self.graph, self.key = group, graph, key
        self.state = state
        d = sharding.to_dict()
        setup = {"value_specs": d["value_specs"], "input_specs": d["input_specs"], "shape": list(sharding.mesh_shape),
                 "io": {"inputs": [(s.kind, s.name, s.node) for s in graph.inputs],
                        "outputs": [(s.kind, s.name, s.node) for s in graph.outputs]},
                 "state": state, "seed": seed}
        if state == "moved":
            setup.update(self._moves(graph, d["value_specs"], tuple(sharding.mesh_shape), train_stages))
        group.call_all(_install_eval, key, graph_bytes(graph.gm), setup)

    @staticmethod
    def _moves(graph, value_specs: dict, shape: tuple[int, int], train_stages: list[tuple]) -> dict:
        """For 'moved': a ``Move`` per state tensor, from the training stage holding it to every rank."""
        import torch

        world = sum(len(ranks) for ranks, _, _ in train_stages)
        dst_mesh = MeshPlacement(shape, tuple(range(world)))
        moves, dtypes, shapes, specs = [], {}, {}, {}
        for s in graph.inputs:
            if s.kind not in ("param", "buffer"):
                continue
            ranks, mesh_shape, stored = next(st for st in train_stages if s.name in st[2])
            dst = str(value_specs.get(s.node, "R" * len(shape)))
            moves.append(Move(s.name, tuple(s.shape), stored[s.name], MeshPlacement(tuple(mesh_shape), tuple(ranks)),
                              dst, dst_mesh))
            dtypes[s.name], shapes[s.name], specs[s.name] = getattr(torch, s.dtype), tuple(s.shape), dst
        return {"moves": moves, "dtypes": dtypes, "shapes": shapes, "specs": specs}

    def load(self, sources: list) -> None:
        """For 'own': the state ``sources`` give (``state_sources``), each rank reading its shards."""
        metas = {s.name: (tuple(s.shape), s.dtype) for s in self.graph.inputs if s.kind in ("param", "buffer")}
        self.group.call_all(_load_eval, self.key, sources, metas)

    def run(self, batch: dict) -> list:
        """The outputs (wire arrays) of the program on ``batch`` (wire arrays)."""
        return self.group.call_all(_run_eval, self.key, batch)[0]
