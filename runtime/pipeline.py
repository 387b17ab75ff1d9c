"""One device's part of a pipelined step: its stage's forward, backward and update.

The driver gives each worker the order of its stage's compute (GPipe or 1F1B
from ``schedule.py``: ('F', k) / ('B', k) for microbatch k). Around each
phase the worker receives the crossings that phase reads and sends the ones it
produced (``comm.py``: exact tiles, tagged, non-blocking sends). Gradients
(the ``alpa.grad`` values) are summed over microbatches and divided by their
number, which equals the full-batch gradient of a mean loss; the update runs
once on the result. The loss is the mean of the microbatch losses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from . import comm
from .interpreter import GRAD_MARKER_NAME, StageRunner


class PipelineRunner:
    """Runs stage ``stage`` of a pipeline on this device."""

    def __init__(self, runner: StageRunner, stage: int, program: dict, crossings: list, meshes: list,
                 specs: list[dict], value_meta: dict, order: list[tuple[str, int]], loss_node: str,
                 gather: list[bool] | None = None):
        self.runner = runner
        self.stage = stage
        by_name = {r[1]: r for r in runner.nodes}
        self.phase_records = {ph: [by_name[n] for n in program[ph]] for ph in ("forward", "backward", "update")}
        self.markers = [r[1] for r in self.phase_records["backward"] if str(r[2]) == GRAD_MARKER_NAME]
        self.crossings = list(enumerate(crossings))
        self.meshes = meshes  # MeshPlacement of every stage
        self.specs = specs  # value_specs (strings) of every stage
        self.value_meta = value_meta
        self.order = order
        self.loss_node = loss_node if loss_node in program["forward"] else None
        self.gather = gather or [False] * len(crossings)
        """Per crossing: resharded with Alpa's local all-gather in the destination mesh."""

    # ------------------------------------------------------------------ comm
    def _src_spec(self, c) -> str:
        spec = self.specs[c.src].get(c.value, "RR")
        return spec.replace("P", "R")

    def _dst_spec(self, c) -> str:
        return self.specs[c.dst].get(c.value, "RR")

    def _receive(self, env: dict, mb: int, phase: str) -> None:
        for i, c in self.crossings:
            if c.dst == self.stage and c.consumed == phase and c.value not in env:
                shape, dtype = self.value_meta[c.value]
                env[c.value] = comm.recv(shape, getattr(torch, dtype), self._src_spec(c), self._dst_spec(c),
                                         self.meshes[c.src], self.meshes[c.dst], self.runner.mesh,
                                         comm.make_tag(i, mb), self.gather[i])

    def _send(self, env: dict, mb: int, phase: str) -> list:
        works = []
        for i, c in self.crossings:
            if c.src == self.stage and c.produced == phase:
                from intra_ilp.spec import ShardingSpec
                from intra_ilp.strategies import to_dtensor_placements

                want = to_dtensor_placements(ShardingSpec.parse(self._src_spec(c)))
                value = self.runner._place(env[c.value], want)
                works += comm.send(value, self._dst_spec(c), self.meshes[c.src], self.meshes[c.dst],
                                   comm.make_tag(i, mb), self.gather[i])
        return works

    # ------------------------------------------------------------------ step
    def _base_env(self, scalars: dict, batch: dict | None) -> dict:
        r = self.runner
        env: dict[str, Any] = {}
        for kind, name, node in r.inputs:
            if kind == "host_scalar":
                env[node] = r._distribute(node, torch.tensor(scalars[name], dtype=torch.float64))
            elif kind == "batch":
                if batch is not None and name in batch:
                    env[node] = r._distribute(node, batch[name])
            elif name in r.state:
                env[node] = r.state[name]
        return env

    def step(self, microbatches: list[dict], scalars: dict) -> float | None:
        r, n_mb = self.runner, len(microbatches)
        envs: dict[int, dict] = {}
        grads: dict[str, DTensor] = {}
        works, losses, last = [], [], None
        for kind, mb in self.order:
            if kind == "F":
                env = envs[mb] = self._base_env(scalars, microbatches[mb])
                phase = "forward"
            else:
                env, phase = envs.pop(mb), "backward"
            self._receive(env, mb, phase)
            r.run_records(self.phase_records[phase], env)
            works += self._send(env, mb, phase)
            if phase == "forward" and self.loss_node is not None:
                losses.append(float(_full(env[self.loss_node])))
            if phase == "backward":
                for m in self.markers:
                    grads[m] = env[m] if m not in grads else grads[m] + env[m]
                last = env
        env = self._base_env(scalars, None)
        env.update({m: g / n_mb if n_mb > 1 else g for m, g in grads.items()})
        r.run_records(self.phase_records["update"], env)
        self._store(env, last or {})
        for work, _ in works:
            work.wait()
        return float(np.mean(losses)) if losses else None

    def _store(self, update_env: dict, last_env: dict) -> None:
        r = self.runner
        for kind, name, node in r.outputs:
            if kind == "loss" or name not in r.state:
                continue
            value = update_env.get(node, last_env.get(node))
            if value is None:
                continue  # unchanged (the output is the stored input itself)
            stored = next(n for k, nm, n in r.inputs if k == kind and nm == name)
            r.state[name] = r._place(value, r.value_specs.get(stored, r.rep))


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value
