"""One device's part of a pipelined step: its stage's forward, backward and update.

The driver gives each worker the order of its stage's compute (the plan's
schedule, ``alpa_torch.core.schedule``: ('F', k) / ('B', k) for microbatch k, and ('W', k)
where the schedule splits the backward: then the 'backward' program computes what is sent
to the stage before and the 'weight' program the rest, ``core.partition.phase_lists``).
Around each phase the worker receives the crossings that phase reads and sends the ones it
produced (``comm.py``: exact tiles, tagged, non-blocking sends). Gradients
(the ``alpa.grad`` values) are summed over microbatches and divided by their
number, which equals the full-batch gradient of a mean loss; the update runs
once on the result. The loss is the mean of the microbatch losses; each stage answers
the driver after its last forward (the loss stage with the loss), so the driver's next
step is on its way during the backward drain and the update.

Memory: each phase is a compiled ``Program`` whose values are freed after their
last reader; a forward value survives only if this stage's backward reads it,
it is sent to another stage (until sent), it is the loss, or it is a step
output. Sent buffers are released as soon as their send completes.

Partial gradients the plan reduces (``grad_buckets.py``) are summed over the
microbatches as partial sums and reduced once, in buckets, during the last
microbatch's backward; the update's first reader of each waits for its bucket.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from alpa_torch.core.spec import ShardingSpec, to_dtensor_placements

from . import comm
from .interpreter import StageRunner, host_scalar
from .program import MARKER
from .replay import ValueMeta, meta_of, wrap
from .timeline import StepRecorder

PHASES = ("forward", "backward", "weight", "update")
_PHASE_OF = {"F": "forward", "B": "backward", "W": "weight"}


class PipelineRunner:
    """Runs stage ``stage`` of a pipeline on this device."""

    def __init__(self, runner: StageRunner, stage: int, program: dict, crossings: list, meshes: list,
                 specs: list[dict], value_meta: dict, order: list[tuple[str, int]], loss_node: str,
                 gather: list[bool] | None = None, combine: str = "mean", recorder: StepRecorder | None = None):
        self.runner = runner
        self.recorder = recorder or StepRecorder()
        """When each phase, transfer and wait of a step ran (``timeline.py``; off unless asked)."""
        self.combine = combine
        """How microbatches add up to the batch (``stage_dp.coupling.loss_combine``): 'mean' or 'sum'."""
        self.stage = stage
        self.crossings = list(enumerate(crossings))
        self.meshes = meshes  # MeshPlacement of every stage
        self.specs = specs  # value_specs (strings) of every stage
        self.value_meta = value_meta
        self.order = order
        self.loss_node = loss_node if loss_node in program["forward"] else None
        self.gather = gather or [False] * len(crossings)
        """Per crossing: resharded with Alpa's local all-gather in the destination mesh."""
        self._send_placements = {c.value: to_dtensor_placements(ShardingSpec.parse(self._src_spec(c)))
                                 for _, c in self.crossings if c.src == stage}
        self._crosses = {(way, c.consumed if way == "recv" else c.produced)
                         for _, c in self.crossings for way in ("recv", "send")
                         if (c.dst if way == "recv" else c.src) == stage}
        """(way, phase) pairs in which this stage receives or sends something (the recorded transfers)."""
        self._compile(program)

    def _compile(self, program: dict) -> None:
        """Each phase's ``Program``, with what must outlive it (see the module docstring)."""
        r = self.runner
        by_name = {rec[1]: rec for rec in r.nodes}
        records = {ph: [by_name[n] for n in program.get(ph, ())] for ph in PHASES}
        outputs = {node for _, _, node in r.outputs}
        sent = {ph: {c.value for _, c in self.crossings if c.src == self.stage and c.produced == ph}
                for ph in ("forward", "backward")}
        weight = r.compile(records["weight"], outputs)
        backward = r.compile(records["backward"], weight.reads | sent["backward"] | outputs)
        backward_reads = backward.reads | weight.reads
        loss = {self.loss_node} if self.loss_node else set()
        self.programs = {
            "forward": r.compile(records["forward"], backward_reads | sent["forward"] | loss | outputs),
            "backward": backward, "weight": weight,
            "update": self._update_program(records["update"]),
        }
        self._update_records = records["update"]
        self.after = {"forward": (sent["forward"] | loss) - backward_reads - outputs,
                      "backward": sent["backward"] - weight.reads - outputs, "weight": set()}
        """Values kept past a phase only to be sent or read as the loss: dropped after that."""
        steps = backward.steps + weight.steps
        read_in_backward = {a for st in steps for a in st.inputs}
        self.markers = [st.name for st in steps if st.kind == MARKER]
        self._keep_marker = {m for m in self.markers if m in read_in_backward}

    def _update_program(self, records: list) -> Any:
        """The update's program: it collects the reduced gradients, and its state is donated."""
        r = self.runner
        return r.compile(records, {node for _, _, node in r.outputs}, collect=True, donate_state=True)

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
                r = self.runner
                local = r.local or r.replaying  # the runner reads local shards
                value = comm.recv(shape, getattr(torch, dtype), self._src_spec(c), self._dst_spec(c),
                                  self.meshes[c.src], self.meshes[c.dst], r.mesh,
                                  comm.make_tag(i, mb), self.gather[i], dtensor=r.learning or not local)
                if r.learning:
                    r.meta[c.value] = meta_of(value)
                    if local:
                        value = value.to_local()
                env[c.value] = value

    def _send(self, env: dict, mb: int, phase: str) -> list:
        works = []
        for i, c in self.crossings:
            if c.src == self.stage and c.produced == phase:
                r = self.runner
                value = r.place(r.as_dtensor(c.value, env[c.value]), self._send_placements[c.value])
                works += comm.send(value, self._dst_spec(c), self.meshes[c.src], self.meshes[c.dst],
                                   comm.make_tag(i, mb), self.gather[i])
        return works

    # ------------------------------------------------------------------ step
    def _base_env(self, scalars: dict, batch: dict | None) -> dict:
        r = self.runner
        env: dict[str, Any] = {}
        for kind, name, node in r.inputs:
            if kind == "host_scalar":
                env[node] = r.distribute(node, host_scalar(scalars[name]))
            elif kind == "batch":
                if batch is not None and name in batch:
                    r.put_batch(env, node, batch[name])
            elif r.has_state(name):
                env[node] = r.state_value(name)
        for st in self._constant_steps():
            env[st.name] = r.constant(st)
        r.enter(env)
        return env

    def _constant_steps(self) -> list:
        """GET_ATTR steps of the graph constants (``get_attr`` records) this stage's programs read.

        ``partition`` gives constants no stage and the phase programs hold only operators, so
        every environment starts with them, as the one-stage engine's program makes them."""
        steps = getattr(self, "_const_steps", None)
        if steps is None:
            r, reads = self.runner, set().union(*(p.reads for p in self.programs.values()))
            steps = self._const_steps = r.compile([rec for rec in r.nodes
                                                   if rec[0] == "get_attr" and rec[1] in reads]).steps
        return steps

    def step(self, microbatches: list[dict], scalars: dict, answer=None) -> float | None:
        """One step of this stage; its loss on the loss stage (else None), also handed to ``answer``
        after the stage's last forward (``worker.DeviceWorker.run_early``)."""
        r, n_mb = self.runner, len(microbatches)
        envs: dict[int, dict] = {}
        self._grads: dict[str, Any] = {}
        self._partials: dict[str, torch.Tensor] = {}
        done = "W" if any(kind == "W" for kind, _ in self.order) else "B"  # a microbatch's last phase
        last_mb = [mb for kind, mb in self.order if kind == done][-1]
        last_forward = max(i for i, (kind, _) in enumerate(self.order) if kind == "F")
        r.rng.begin_step()
        rec = self.recorder
        rec.begin_step()
        if r.buckets is not None:
            r.buckets.begin(scale=n_mb if self.combine == "mean" else 1)
        works, losses, last = [], [], None
        for at, (kind, mb) in enumerate(self.order):
            phase = _PHASE_OF[kind]
            if kind == "F":
                env = envs[mb] = self._base_env(scalars, microbatches[mb])
            else:
                env = envs.pop(mb) if kind == done else envs[mb]
            if ("recv", phase) in self._crosses:
                with rec.span("recv", "transfer", microbatch=mb, phase=phase):
                    self._receive(env, mb, phase)
            r.rng.microbatch = mb
            final = mb == last_mb
            with rec.span(f"{kind}{mb}", phase, microbatch=mb):
                r.run(self.programs[phase], env, None if phase == "forward" else
                      (lambda name, value, meta, final=final: self._grad(name, value, meta, final)))
            if ("send", phase) in self._crosses:
                with rec.span("send", "transfer", microbatch=mb, phase=phase):
                    works += self._send(env, mb, phase)
            if phase == "forward" and self.loss_node is not None:
                losses.append(float(_full(r.as_dtensor(self.loss_node, env[self.loss_node]))))
            if at == last_forward and answer is not None:
                answer(self._combined(losses))
            for name in self.after[phase]:
                env.pop(name, None)
            if phase != "forward":
                last = env
            works = [w for w in works if not w[0].is_completed()]  # sent: their buffers can go
        env = self._base_env(scalars, None)
        r.rng.microbatch = -1  # the update
        divide = n_mb > 1 and self.combine == "mean"
        grads = {m: g / n_mb if divide else g for m, g in self._grads.items()}
        r.enter(grads)
        env.update(grads)
        self._grads = {}
        with rec.span("U", "update"):
            r.run(self.programs["update"], env)
        if r.buckets is not None:
            with rec.span("gradient buckets", "collective"):
                r.buckets.finish()
        self._store(env, last or {})
        if works:
            with rec.span("send wait", "transfer"):
                for work, _ in works:
                    work.wait()
        learnt = r.learning
        r.end_step()
        if learnt and r.bucket_mates:  # the buckets are known: collected a bucket at a time
            self.programs["update"] = self._update_program(self._update_records)
        return self._combined(losses)

    def _combined(self, losses: list[float]) -> float | None:
        """The step's loss from its microbatches' (None on a stage without the loss)."""
        if not losses:
            return None
        return float(np.mean(losses) if self.combine == "mean" else np.sum(losses))

    def _grad(self, name: str, value, meta, final: bool) -> bool:
        """Sum gradient ``name`` over microbatches; a bucketed one goes to its bucket once final.

        ``meta``: the gradient's ``ValueMeta`` (None on one device). Returns whether the
        value was taken (else the backward still reads it)."""
        r = self.runner
        if name not in r.reductions:
            if r.replaying and any(p.is_partial() for p in meta.placements):
                value = wrap(value, meta, r.mesh)  # partial sums: the same DTensor arithmetic as when learning
            prev = self._grads.get(name)
            self._grads[name] = value if prev is None else prev + value
            return name not in self._keep_marker
        local = value if r.replaying else value.to_local()  # this device's summand of a partial sum
        prev = self._partials.pop(name, None)
        total = local if prev is None else prev + local
        if not final:
            self._partials[name] = total
        elif not r.buckets.put(name, total, meta.placements, meta.shape):
            # not as planned: DTensor reduces it in the update
            self._grads[name] = _as_dtensor(total, meta, r.mesh)
        return name not in self._keep_marker

    def _store(self, update_env: dict, last_env: dict) -> None:
        r = self.runner
        for kind, name, node in r.outputs:
            if kind == "loss" or not r.has_state(name):
                continue
            value = update_env.get(node, last_env.get(node))
            if value is None:
                continue  # unchanged (the output is the stored input itself)
            r.store(kind, name, node, value)


def _as_dtensor(local: torch.Tensor, meta: ValueMeta, mesh) -> DTensor:
    local = local.contiguous()
    shape = meta.shape
    stride = tuple(math.prod(shape[k + 1:]) for k in range(len(shape)))
    return DTensor.from_local(local, mesh, meta.placements, run_check=False, shape=shape, stride=stride)


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value
