"""The local program of one device: a planned graph executed on DTensors.

Each operator runs on DTensors whose placements are the ones the plan chose:
before an operator, every input is redistributed to the spec of the chosen
strategy (``StageSharding.input_specs``), which inserts exactly the
collectives the ILP priced (all-reduce for P -> R, all-gather for S -> R, ...);
DTensor's own rules then compute the local result. Operators DTensor has no
rule for run on the full (replicated) values, as the planner assumed. How one
operator runs is ``operator_calls.py``; this module runs the step.

What keeps the per-step cost near eager PyTorch's:

- the records are compiled once (``program.py``): every value is deleted from the
  environment after its last reader (liveness), so memory is given back during the
  step; once every operator's way of running is settled (from the first step on one
  device, after the learning step elsewhere) the program runs as one generated
  function (``codegen.py``), with no per-operator interpreter work;
- partial gradients the plan reduces are reduced in flat asynchronous buckets
  (``grad_buckets.py``), waited for by their first reader in the update;
- the first step runs every operator through DTensor and records how it ran;
  later steps replay that on local tensors (``replay.py``): the plan's
  redistributions, then the kernel DTensor's own sharding rule runs on the
  shards (decided from placements, so it holds whatever the values), or
  DTensor itself where its dispatcher does more than one kernel (a random
  operator, a redistribution inside the call, a custom handler). This takes
  DTensor's ~80 us of Python per operator off every later step.
  ``ALPA_TORCH_REPLAY=0`` in the workers' environment keeps DTensor for every
  step (a debugging switch);
- elementwise operators whose first input dies with them (the optimizer update:
  ``exp_avg.lerp(grad, w)``, ``param * decay``) write their result into that
  input's memory, as eager's in-place optimizer does (``donation.py``);
- on a one-device mesh there is nothing to shard: operators run on plain
  tensors from the start (``self.local``); values become DTensors only where
  they cross to another stage (``pipeline.py``).

This module runs inside a worker process; the driver side is ``engine.py``.
It needs a default process group (gloo or NCCL) spanning the mesh's ranks.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import alpa_torch.core.op_rules  # noqa: F401 - DTensor rules the graphs need (aten.copy)
from alpa_torch.core.grad_op import GRAD_MARKER_NAME
from alpa_torch.core.spec import ShardingSpec, to_dtensor_placements

from .codegen import Layout, generate
from .devices import mesh_device
from .donation import INPLACE, donating, find_donations, state_overwrites
from .grad_buckets import (
    BUCKET_CAP_BYTES,
    GradBuckets,
    bucket_groups,
    bucketed_order,
    deferred_wants,
    find_reductions,
    gather_replicated,
    mesh_is_world,
)
from .loss_parts import LossPart, device_part
from .operator_calls import FULL_BATCH, OperatorCalls
from .program import (
    CALL,
    GET_ATTR,
    GETITEM,
    MARKER,
    OUTPUT,
    Program,
    Ref,
    Slot,
    compile_program,
    record_target,
    serialize_graph,
)
from .replay import StepReplay, agree, local_layout, meta_of, wrap
from .rng import RandomStream, is_random
from .state_sources import shard
from .switches import DONATE_ENV, REPLAY_ENV, switch_on
from .wire import Bits, from_wire

log = logging.getLogger(__name__)
__all__ = ["GRAD_MARKER_NAME", "Ref", "StageRunner", "serialize_graph"]


def host_scalar(value) -> torch.Tensor:
    """A host-scalar input as the graph reads it: a hyper-parameter (a float) as a float64 0-dim
    tensor, a value the driver computed (``OpGraph.host_inputs``) as it came."""
    return value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)


class StageRunner(OperatorCalls):
    """Holds one device's shards of the model state and runs the planned step (how each operator
    runs: ``operator_calls.py``)."""

    def __init__(self, records: list[tuple], value_specs: dict[str, str], input_specs: dict[str, list[str]],
                 io: dict, mesh: DeviceMesh, bucket_cap_bytes: int = BUCKET_CAP_BYTES, seed: int = 0,
                 donate_state: bool = True, compile_regions: bool = False, region_cache: str | None = None):
        """``donate_state``: a step may write into state memory the runner owns (False: an evaluation
        reading state it does not own, ``evaluation.py``). ``compile_regions``: once settled, runs of
        local kernels are compiled by Inductor (``regions.py``)."""
        self.mesh = mesh
        self.device = mesh_device(mesh)
        """Where this device's tensors live: the mesh's device type (``cuda``: the worker's GPU)."""
        self.local = mesh.size() == 1
        """One device: plain tensors, no DTensor (every placement is trivially satisfied)."""
        self.rep = (Replicate(),) * self.mesh.ndim
        self.value_specs = {k: to_dtensor_placements(ShardingSpec.parse(v)) for k, v in value_specs.items()}
        self.input_specs = {k: [to_dtensor_placements(ShardingSpec.parse(s)) for s in v]
                            for k, v in input_specs.items()}
        self.inputs = io["inputs"]  # [(kind, name, node)]
        self.outputs = io["outputs"]
        self._loss_node = next((node for kind, _, node in self.outputs if kind == "loss"), None)
        self._answer: Callable[[Any], None] | None = None
        """During ``step``: where the loss goes as soon as the forward computed it (``_loss_ready``)."""
        self._early_loss: float | LossPart | None = None
        self.stored_node = {(kind, name): node for kind, name, node in self.inputs}
        self._state_node = {name: node for kind, name, node in self.inputs if kind in ("param", "buffer", "opt_state")}
        self._state: dict[str, DTensor | torch.Tensor] = {}
        """Model state by input name: DTensors; plain tensors on one device; local shards when replaying."""
        self.local_only: set[str] = set()
        self.contiguous_views: set[str] = set()
        """Views whose input shard arrives with strides a view refuses: they view a contiguous copy."""
        self.nodes = [(op, name, record_target(t) if op == "call_function" else t, a, k, i)
                      for op, name, t, a, k, i in records]
        self.reductions = {} if self.local else find_reductions(
            self.nodes, self.value_specs, self.input_specs, GRAD_MARKER_NAME)
        self.input_specs.update(deferred_wants(self.reductions, self.input_specs))
        self.buckets = GradBuckets(mesh, self.reductions, bucket_cap_bytes) if self.reductions else None
        self.world_mesh = not self.local and mesh.ndim > 1 and mesh_is_world(mesh)
        """A 2-D mesh of every rank: values partial / sharded over both axes become replicated in one
        collective over the default group, not one per axis (``grad_buckets.replicate_over_world``)."""
        self._constants: dict[str, Any] = {}
        self.replay_enabled = switch_on(REPLAY_ENV)
        """Whether the first step learns a replay on local tensors (``replay.py``)."""
        self.replaying = False
        """After the first step: operators replayed on local tensors."""
        self.replay: dict[str, StepReplay] = {}
        self.meta: dict[str, Any] = {}
        """Name -> ``ValueMeta`` of every value seen while learning."""
        self.compile_regions, self.region_cache = compile_regions, region_cache
        self.overwrite_state = switch_on(DONATE_ENV)
        """Whether a step may write the new state into the old state's memory where the runner owns it."""
        self.donate_enabled = self.overwrite_state and not compile_regions
        """Whether operators may run in place on dead inputs (``donation.py``; compiled regions reuse memory
        their own way); set before the first step."""
        self._owned: set[str] = set()
        """State nodes whose tensors this runner owns outright (state memory a step may donate)."""
        self._foreign: set[str] = set()
        """State names holding memory given to ``load_state``, not yet replaced by a step's result."""
        self.rng = RandomStream(seed)
        """Seeds each random operator (``rng.py``); pipelines set its microbatch."""
        self._random = {name: self._shard_coords(name) for op, name, t, *_ in self.nodes
                        if op == "call_function" and is_random(t)}
        """Random operator -> this device's coordinates on the axes that shard its output."""
        self._donate_state = donate_state
        self.bucket_mates: dict[str, tuple[str, ...]] = {}
        """Each bucketed gradient's bucket (its names), known after the learning step (``_collect_before``)."""
        self.program = self.compile(self.nodes, collect=True, donate_state=donate_state)
        if self.reductions:
            log.info("%d of the step's gradients reduced in buckets", len(self.reductions))

    def compile(self, records: list[tuple], keep: Iterable[str] = (), collect: bool = False,
                donate_state: bool = False) -> Program:
        """``records`` as a ``Program``; with ``collect``, bucketed gradients are collected at their first
        reader; with ``donate_state``, it is the last reader of the state in a step: its operators may
        overwrite state memory the runner owns (``donation.py``)."""
        program = compile_program(records, GRAD_MARKER_NAME, keep)
        if collect and self.reductions:
            self._collect_before(program)
        state_nodes = frozenset(self._state_node.values()) if donate_state else frozenset()
        for name, donation in find_donations(program, state_nodes).items():
            program.step(name).donate = donation
        if state_nodes:
            program.overwrites = state_overwrites(program, state_nodes)
        return program

    def _collect_before(self, program: Program) -> None:
        """Mark where each bucketed gradient is collected: at its first reader, or, once the buckets are
        known (``bucket_mates``), with its whole bucket at the first reader of any of them, where every
        one of their markers runs before that (or in an earlier phase). A bucket is waited for once
        either way; this way a compiled region is cut once per bucket, not once per gradient (the
        update of every parameter a region of its own)."""
        first = program.first_readers(self.reductions)
        index = {st.name: i for i, st in enumerate(program.steps)}
        for name, st in first.items():
            mates = [n for n in self.bucket_mates.get(name, (name,)) if n in first]
            at = min(index[first[n].name] for n in mates)
            if any(index.get(n, -1) >= at for n in mates):  # a mate's gradient is not yet in its bucket there
                at = index[st.name]
            program.steps[at].before += (name,)

    def _shard_coords(self, name: str) -> tuple[int, ...]:
        if self.local:
            return ()
        coords = self.mesh.get_coordinate()
        return tuple(c if p.is_shard() else 0 for c, p in zip(coords, self.value_specs.get(name, self.rep)))

    # ---------------------------------------------------------------- state
    def distribute(self, node: str, value: np.ndarray | Bits | torch.Tensor) -> DTensor | torch.Tensor:
        """The full value of graph value ``node`` (a wire array or a tensor) as this device holds it:
        a DTensor placed as the plan stores it (a plain tensor on one device)."""
        t = (value if isinstance(value, torch.Tensor) else from_wire(value)).to(self.device)
        if self.local:
            return t
        placements = self.value_specs.get(node, self.rep)
        return distribute_tensor(t, self.mesh, placements, src_data_rank=None)

    def load_state(self, values: dict[str, Any]) -> None:
        """Take full values of params / buffers / optimizer state; keep this device's shards.

        Values not in ``values`` (state of other stages) are skipped."""
        for kind, name, node in self.inputs:
            if kind in ("param", "buffer", "opt_state") and name in values:
                self._put_state(name, node, self.distribute(node, values[name]))

    def load_from(self, sources: list, metas: dict[str, tuple[tuple[int, ...], str]]) -> None:
        """Take this device's shards of the state named in ``metas`` (name -> full shape, dtype
        name) from ``sources`` (``state_sources``): only the slices it holds are read."""
        mesh = None if self.local else self.mesh
        for kind, name, node in self.inputs:
            if kind in ("param", "buffer", "opt_state") and name in metas:
                self._put_state(name, node, shard(sources, name, *metas[name], mesh,
                                                  self.value_specs.get(node, self.rep), self.device))

    def _put_state(self, name: str, node: str, value) -> None:
        self._state[name] = value.to_local() if self.replaying else value
        self._foreign.add(name)
        self._owned.discard(node)

    @property
    def state(self) -> dict[str, DTensor | torch.Tensor]:
        """This device's state as DTensors (plain tensors on a one-device mesh), by input name."""
        if not self.replaying:
            return self._state
        return {name: wrap(v, self.meta[self._state_node[name]], self.mesh) for name, v in self._state.items()}

    def has_state(self, name: str) -> bool:
        return name in self._state

    def state_value(self, name: str):
        """State ``name`` as the environment holds it (a local tensor when replaying)."""
        return self._state[name]

    def store(self, kind: str, name: str, node: str, value) -> None:
        """Keep the step's new value (of graph value ``node``) as state ``name``, placed as the plan stores it."""
        stored = self.stored_node[(kind, name)]
        want = self.value_specs.get(stored, self.rep)
        self._foreign.discard(name)
        if self._local_as_wanted(node, value, want):
            self._state[name] = value
            return
        value = self.place(self.as_dtensor(node, value), want)
        self._state[name] = value.to_local() if self.replaying else value

    def _local_as_wanted(self, node: str, value, want: tuple) -> bool:
        """A replayed (local) value of graph value ``node`` already placed as ``want``."""
        return (self.replaying and isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
                and self.meta[node].placements == want)

    def _gather_stores(self, stores: list[tuple]) -> dict[str, DTensor | torch.Tensor]:
        """New state computed sharded that the plan stores replicated (an update run on slices):
        all-gathered in flat buckets (``grad_buckets.gather_replicated``), by state name (local
        tensors when replaying)."""
        if self.local:
            return {}
        todo = {}
        for kind, name, node, value in stores:
            want = self.value_specs.get(self.stored_node[(kind, name)], self.rep)
            if self._local_as_wanted(node, value, want):
                continue
            value = self.as_dtensor(node, value)
            if (isinstance(value, DTensor) and value.placements != want
                    and all(isinstance(p, Replicate) for p in want)):
                todo[name] = value
        return gather_replicated(self.mesh, todo, local=self.replaying) if todo else {}

    def gather_state(self, names=None) -> dict[str, torch.Tensor]:
        """Full values of this runner's state (only ``names`` if given; a collective among its mesh's devices)."""
        return {name: value.full_tensor() if isinstance(value, DTensor) else value
                for name, value in self.state.items() if names is None or name in names}

    # ---------------------------------------------------------------- step
    @property
    def learning(self) -> bool:
        """This step runs every operator through DTensor and records what to replay (``replay.py``)."""
        return not self.local and not self.replaying

    def put_batch(self, env: dict, node: str, value: np.ndarray) -> None:
        """Batch leaf ``node`` into ``env``, placed as the plan says; where that shards it, the
        whole leaf too (``FULL_BATCH``)."""
        env[node] = self.distribute(node, value)
        if not self.local and any(not p.is_replicate() for p in self.value_specs.get(node, self.rep)):
            env[(FULL_BATCH, node)] = from_wire(value).to(self.device)

    def step(self, batch: dict[str, np.ndarray], scalars: dict[str, float],
             answer: Callable[[Any], None] | None = None) -> float | LossPart:
        """One training step; its loss (``LossPart`` where the plan leaves it partial: ``total_loss``),
        also handed to ``answer`` as soon as the forward has computed it."""
        self._answer, self._early_loss = answer, None
        self.rng.begin_step()
        env: dict[str, Any] = {}
        for kind, name, node in self.inputs:
            if kind == "batch":
                self.put_batch(env, node, batch[name])
            elif kind == "host_scalar":
                env[node] = self.distribute(node, host_scalar(scalars[name]))
            else:
                env[node] = self._state[name]
        self.enter(env)
        if self.buckets is not None:
            self.buckets.begin()
        results = self.run(self.program, env)
        if self.buckets is not None:
            self.buckets.finish()
        loss, stores = None, []
        for (kind, name, node), value in zip(self.outputs, results):
            if kind == "loss":
                early = self._early_loss
                loss = early if early is not None else self._loss_out(self.as_dtensor(node, value))
                continue
            stores.append((kind, name, node, value))
        gathered = self._gather_stores(stores)
        for kind, name, node, value in stores:
            if name in gathered:  # replicated, as stored (a local tensor when replaying)
                self._state[name] = gathered[name]
                self._foreign.discard(name)
            else:
                self.store(kind, name, node, value)
        self.end_step()
        self._answer = None
        return loss

    def evaluate(self, batch: dict[str, np.ndarray]) -> list[torch.Tensor]:
        """A forward-only program (``evaluation.py``) on ``batch``: its outputs whole on every device (a
        collective), the state left as it was."""
        self.rng.begin_step()
        env: dict[str, Any] = {}
        for kind, name, node in self.inputs:
            if kind == "batch":
                self.put_batch(env, node, batch[name])
            else:
                env[node] = self._state[name]
        self.enter(env)
        results = self.run(self.program, env)
        outs = []
        for (_, _, node), value in zip(self.outputs, results):
            value = self.as_dtensor(node, value)
            outs.append(value.full_tensor() if isinstance(value, DTensor) else value)
        self.end_step()
        return outs

    def drop_state(self) -> None:
        """Let go of every state tensor (an evaluation's copies, before the state changes)."""
        self._state.clear()

    def _loss_ready(self, value) -> None:
        """The loss, just computed by the forward: to the step's ``answer``, if it has one."""
        if self._answer is not None:
            self._early_loss = self._loss_out(self.as_dtensor(self._loss_node, value))
            answer, self._answer = self._answer, None
            answer(self._early_loss)

    def _loss_out(self, loss) -> float | LossPart:
        """The loss as the driver adds it up (``loss_parts.device_part``)."""
        return device_part(loss, self.mesh, lambda value: self.place(value, self.rep))

    def enter(self, env: dict[str, Any]) -> None:
        """Values the caller put in ``env``: noted while learning, local tensors when replaying."""
        if self.learning and self.replay_enabled:
            for k, v in env.items():
                self.meta[k] = meta_of(v)
        elif self.replaying:
            for k, v in env.items():
                if isinstance(v, DTensor):
                    env[k] = v.to_local()

    def end_step(self) -> None:
        """After the first step: every device agrees on what runs locally, then replays.
        After every step: which state tensors the runner now owns outright."""
        if self.learning and self.replay_enabled:
            safe = agree({n: rp.call is not None for n, rp in self.replay.items()}, self.mesh)
            for n, rp in self.replay.items():
                if not safe[n]:
                    rp.call = None
            self.replaying = True
            if self.buckets is not None and self.buckets.seen:  # each bucket's reduction where its gradients are
                groups = bucket_groups(self.nodes, self.buckets.seen, self.buckets.cap_bytes)
                self.bucket_mates = {n: tuple(names) for _, names in groups for n in names}
                self.program = self.compile(bucketed_order(self.nodes, groups),
                                            collect=True, donate_state=self._donate_state)
            self._state = {name: v.to_local() if isinstance(v, DTensor) else v for name, v in self._state.items()}
            log.info("replaying %d of %d operators on local tensors", sum(safe.values()), len(safe))
        self._note_owned()

    def _note_owned(self) -> None:
        """State a later step may donate: plain tensors that are not views, hold no memory given to
        ``load_state`` and share their storage with no other state entry."""
        self._owned.clear()
        if not self.overwrite_state:
            return
        storage_of = {name: t.untyped_storage().data_ptr() for name, t in self._state.items()
                      if type(t) is torch.Tensor and t._base is None and name not in self._foreign}
        holders = Counter(storage_of.values())
        self._owned.update(self._state_node[name] for name, ptr in storage_of.items() if holders[ptr] == 1)

    def _state_writes(self, program: Program) -> dict[str, tuple[str, int, frozenset[str]]]:
        """New state value -> ``(state input, i, shared)``: the state input whose memory a compiled region
        holding step ``i`` may write the value into (``donation.state_overwrites``), where the value is
        stored as computed (no gather, no other placement) and stored once."""
        if not (self.compile_regions and self.overwrite_state):
            return {}
        stored = Counter(node for _, _, node in self.outputs)
        out = {}
        for kind, name, node in self.outputs:
            state = None if kind == "loss" else self._state_node.get(name)
            if state not in program.overwrites or stored[node] > 1 or node == state:
                continue
            meta = None if self.local else self.meta.get(node)
            if self.local or (meta is not None and meta.placements == self.value_specs.get(state, self.rep)):
                out[node] = (state, *program.overwrites[state])
        return out

    def _donor(self, st, op) -> Callable | None:
        """``(args, kwargs) -> result`` of ``op`` for a donating step (``donation.donating``), or None."""
        if st.donate is None or not self.donate_enabled:
            return None
        return donating(op, getattr(INPLACE[st.target], "_op", INPLACE[st.target]), st.donate.state, self._owned)

    def run(self, program: Program, env: dict[str, Any],
            on_grad: Callable[[str, Any, Any], bool] | None = None) -> list | None:
        """Run ``program``, reading and writing ``env``; the output's values if reached.

        ``on_grad(name, value, meta)`` receives every gradient at its marker (a pipeline
        accumulates microbatches; ``meta``: its ``ValueMeta``, None on one device); it
        returns whether it took the value (then it is not put in ``env``). Without it,
        bucketed gradients go to ``self.buckets``."""
        if self.local or self.replaying:  # every operator's way of running is settled: straight-line code
            if program.fast is None or program.fast.on_grad != (on_grad is not None):
                named = on_grad is None  # a marker's hook only names the value unless a pipeline or bucket takes it
                alias = (lambda st: named and st.name not in self.reductions) if self.compile_regions else None
                program.fast = generate(program, self._layout, self._general, self._marker, self._collect,
                                        self.constant, {self._loss_node: self._loss_ready} if self._loss_node else None,
                                        alias, self.region_cache, self._state_writes(program), self._owned)
                program.fast.on_grad = on_grad is not None
            return program.fast(env, on_grad)
        learning = self.learning and self.replay_enabled  # metadata for the replay: only when learning one
        call = self._call_learn if self.replay_enabled else self._call_dist
        for st in program.steps:
            kind = st.kind
            if st.before:
                self._collect(st.before, env)
            if kind == CALL:
                if st.name in self._random:
                    self.rng.seed_op(st.name, self._random[st.name])
                env[st.name] = call(st, env)
            elif kind == GETITEM:
                env[st.name] = env[st.inputs[0]][st.target]
            elif kind == MARKER:
                self._marker(st.name, st.inputs[0], env, on_grad)
            elif kind == GET_ATTR:
                env[st.name] = self.constant(st)
            elif kind == OUTPUT:  # local tensors when replaying: ``as_dtensor`` / ``store`` wrap them
                return [env[a] if isinstance(a, Ref) else a for a in st.target]
            if learning and kind != MARKER and st.name in env:
                self.meta[st.name] = meta_of(env[st.name])
            if st.name == self._loss_node and kind in (CALL, GETITEM):
                self._loss_ready(env[st.name])
            for name in st.free:
                env.pop(name, None)
        return None

    def _marker(self, name: str, src: str, env: dict, on_grad) -> None:
        value = env[src]
        meta = None if self.local else self.meta.get(src)  # the gradient's placements, as produced
        if self.learning:
            meta = self.meta[name] = meta_of(value)
        if on_grad is not None:
            if not on_grad(name, value, meta):
                env[name] = value
            return
        if name in self.reductions:
            local = value if self.replaying else value.to_local()
            if self.buckets.put(name, local, meta.placements, meta.shape):
                return
        env[name] = value

    def _collect(self, names: tuple[str, ...], env: dict) -> None:
        for name in names:
            if self.buckets.has(name):
                value = self.buckets.take(name, local=self.replaying)
                if self.learning and self.replay_enabled:
                    self.meta[name] = meta_of(value)
                env[name] = value

    def constant(self, st):
        """A graph constant (``get_attr`` step), replicated on this mesh once and kept."""
        if self.local or self.replaying:
            return st.target
        value = self._constants.get(st.name)
        if value is None:
            value = self._constants[st.name] = self.place(st.target, self.rep)
        return value

    # ---------------------------------------------------------------- one operator
    def _layout(self, st) -> Layout | None:
        """``st`` as one direct call of the generated program (``codegen.py``): its kernel on one device,
        the local kernel learnt when replaying, in place where ``donation.py`` allows; or None."""
        if st.name in self._random:
            return None
        if self.local:
            args, kwargs = st.layout()
            op = st.target
        else:
            rp = self.replay[st.name]
            layout = local_layout(rp.call, st) if rp.call is not None and not rp.redistribute else None
            if layout is None:
                return None
            op, args, kwargs = layout
        kernel, donor = getattr(op, "_op", op), None
        if (st.donate is not None and op is st.target and args and isinstance(args[0], Slot)
                and st.inputs[args[0].i] == st.inputs[st.donate.slot]):
            donor = self._donor(st, kernel)
        return Layout(donor, args, kwargs, donor=True) if donor is not None else Layout(kernel, args, kwargs, op=op)

    def _general(self, st) -> Callable[[dict], Any]:
        """``env -> value`` of an operator the generated program does not call directly."""
        call = self._call_local if self.local else self._replay
        coords = self._random.get(st.name)
        if coords is None:
            return lambda env: call(st, env)
        return lambda env: (self.rng.seed_op(st.name, coords), call(st, env))[1]
