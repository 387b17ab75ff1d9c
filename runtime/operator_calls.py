"""How one operator runs on a device's mesh: the methods ``interpreter.StageRunner`` calls per step.

- ``place``: a value redistributed to the placements the plan wants, by the path the cost
  model priced (one collective over a whole-cluster mesh, one all-to-all, else DTensor's);
- the first step (``_call_learn``): every operator on DTensors, its inputs placed as the plan's
  input specs say; what ran is recorded (``replay.StepReplay``);
- later steps (``_replay``): the recorded redistributions on local tensors, then the local
  kernel, or DTensor itself where its dispatcher does more than one kernel;
- an operator DTensor has no rule for runs on the full (replicated) values, as the planner
  assumed; a view DTensor refuses on a redistributed shard views a contiguous copy.

``OperatorCalls`` holds no state of its own: it reads the runner's mesh and specs (``mesh``,
``device``, ``local``, ``rep``, ``world_mesh``, ``input_specs``), what the first step learnt
(``replay``, ``meta``, ``replaying``, ``local_only``, ``contiguous_views``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from .grad_buckets import replicate_over_world, shard_to_shard
from .replay import InputMeta, StepReplay, check_local, meta_of, run_local, to_local, wrap

FULL_BATCH = "full batch"
"""``env[(FULL_BATCH, node)]``: the whole batch leaf ``node`` as it arrived (every device receives
all of it), where the plan shards it: a redistribution of it to replicated is a lookup."""


class OperatorCalls:
    """The runner's per-operator paths (module docstring); ``StageRunner`` is one."""

    def as_dtensor(self, name: str, value):
        """``value`` of ``name`` as the DTensor it stands for (a replayed value is a local tensor).

        A value that was a plain tensor when learning (no metadata: a factory operator such as
        the ``scalar_tensor(0)`` of ``where``'s backward, which reads no DTensor) stays plain,
        as it was then; a pipeline stage may send it (``pipeline._send`` replicates it)."""
        if self.replaying and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            meta = self.meta.get(name)
            if meta is not None:
                return wrap(value, meta, self.mesh)
        return value

    def place(self, value, placements):
        """``value`` redistributed to ``placements`` on this runner's mesh, by the path the cost model
        priced (one collective over a whole-cluster mesh where that applies, ``shard_to_shard``'s
        all-to-all, else DTensor's); a value turning partial is left to DTensor's dispatcher."""
        if self.local:
            return value.to_local() if isinstance(value, DTensor) else value
        if not isinstance(value, DTensor):
            value = DTensor.from_local(torch.as_tensor(value).to(self.device), self.mesh, self.rep, run_check=False)
        if value.placements != placements:
            if any(p.is_partial() and p != q for p, q in zip(placements, value.placements)):
                # Turning a value into a partial sum is DTensor-internal: its
                # dispatcher does it when the operator's rule asks for it.
                return value
            fast = None
            if self.world_mesh and (placements == self.rep or (
                    all(p.is_partial() for p in value.placements) and not any(p.is_partial() for p in placements))):
                # One collective over every rank, then local slices (what the cost model prices:
                # ``intra_ilp.cost_model``, world paths).
                fast = replicate_over_world(value, self.mesh)
                if fast is not None and placements != self.rep:
                    fast = fast.redistribute(self.mesh, placements)
            if fast is None:
                fast = shard_to_shard(value, placements)
            value = fast if fast is not None else value.redistribute(self.mesh, placements)
        return value

    def _call_local(self, st, env: dict[str, Any]):
        args, kwargs = st.resolve([env[a] for a in st.inputs])
        return st.target(*args, **kwargs)

    def _placed_inputs(self, st, env: dict[str, Any], with_metas: bool = True) -> tuple[list, list]:
        """Inputs redistributed to the plan's input specs, and their ``InputMeta`` (None: not a tensor;
        none at all without ``with_metas``: only learning a replay reads them)."""
        specs = self.input_specs.get(st.name)
        n_specs = len(specs) if specs is not None else 0
        values, metas, j = [], [], 0
        for a in st.inputs:
            v = env[a]
            if isinstance(v, torch.Tensor):
                want = specs[j] if j < n_specs else self.rep
                j += 1
                full = env.get((FULL_BATCH, a)) if want == self.rep else None
                if full is not None:  # the batch leaf, as it arrived: no all-gather
                    placed = DTensor.from_local(full, self.mesh, self.rep, run_check=False)
                else:
                    placed = v if isinstance(v, DTensor) and v.placements == want else self.place(v, want)
                if with_metas:
                    metas.append(InputMeta(meta_of(v), meta_of(placed) if placed is not v else None))
                v = placed
            elif with_metas:
                metas.append(None)
            values.append(v)
        return values, metas

    def _call_dist(self, st, env: dict[str, Any]):
        values, _ = self._placed_inputs(st, env, with_metas=False)
        return self._call_dtensor(st, st.resolve(values))

    def _call_learn(self, st, env: dict[str, Any]):
        values, metas = self._placed_inputs(st, env)
        out = self._call_dtensor(st, st.resolve(values))
        plain = st.name not in self.contiguous_views and st.name not in self.local_only
        rp = StepReplay(tuple(metas), check_local(st, values, out) if plain else None)
        if st.name in self.replay:
            self.replay[st.name].merge(rp)
        else:
            self.replay[st.name] = rp
        return out

    def _replay(self, st, env: dict[str, Any]):
        """One operator replayed: the plan's redistributions, then the local kernel, or DTensor."""
        rp = self.replay[st.name]
        values = [env[a] for a in st.inputs]
        for i, have, placements in rp.redistribute:
            full = env.get((FULL_BATCH, st.inputs[i])) if placements == self.rep else None
            values[i] = full if full is not None else self._redistribute_local(values[i], have, placements)
        if rp.call is not None:
            return run_local(rp.call, *st.resolve(values))
        for i, m in enumerate(rp.inputs):
            if m is not None:
                values[i] = wrap(values[i], m.placed or m.have, self.mesh)
        return to_local(self._call_dtensor(st, st.resolve(values)))

    def _redistribute_local(self, local: torch.Tensor, have, placements: tuple) -> torch.Tensor:
        """This device's tensor of ``local`` (placed as ``have``; None: replicated) redistributed to
        ``placements``. Replicated to sharded on one mesh axis is a local chunk: DTensor's own
        ``Shard._replicate_to_shard``, without wrapping; anything else goes through DTensor."""
        if have is None or all(p.is_replicate() for p in have.placements):
            split = [(axis, p) for axis, p in enumerate(placements) if not p.is_replicate()]
            if len(split) == 1 and split[0][1].is_shard():
                axis, shard = split[0]
                return shard._replicate_to_shard(local, self.mesh, axis, self.mesh.get_local_rank(axis))
        value = local if have is None else wrap(local, have, self.mesh)
        return self.place(value, placements).to_local()

    def _call_dtensor(self, st, resolved: tuple[tuple, dict]):
        args, kwargs = resolved
        if st.name in self.contiguous_views:
            return st.target(args[0].contiguous(), *args[1:], **kwargs)
        if st.name not in self.local_only:
            try:
                return st.target(*args, **kwargs)
            except NotImplementedError:  # no DTensor rule: the plan kept it replicated
                self.local_only.add(st.name)
            except RuntimeError as exc:
                # A redistributed shard can have other strides than the value eager viewed:
                # the graph is functional, so viewing a contiguous copy gives the same values.
                if st.target is not torch.ops.aten.view.default or not any(
                        words in str(exc) for words in ("view size is not compatible", "Cannot view a tensor")):
                    raise
                self.contiguous_views.add(st.name)
                return st.target(args[0].contiguous(), *args[1:], **kwargs)
        return self._run_replicated(st.target, args, kwargs)

    def _run_replicated(self, target, args, kwargs):
        def full(v):
            return v.redistribute(self.mesh, self.rep).to_local() if isinstance(v, DTensor) else v

        args, kwargs = pytree.tree_map(full, (args, kwargs))
        out = target(*args, **kwargs)
        return pytree.tree_map(
            lambda v: DTensor.from_local(v, self.mesh, self.rep, run_check=False) if isinstance(v, torch.Tensor) else v,
            out,
        )


__all__ = ["FULL_BATCH", "OperatorCalls"]
