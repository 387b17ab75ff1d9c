"""x_ab of ``stage_costs``: the resharding between the layers of one stage.

Owns: every edge between two layers (``Stitching.cross_edges``) and its price under the
specs the layers' ILP solutions chose (``Stitching.costs``): forward/backward, update, and the
α part of forward/backward; where the edge is a gradient reduction the runtime runs in a
bucket (``alpa_torch.core.grad_reductions``), the bucket's price (``layer_parts.bucket_s``).
Does not own a layer's own costs (``layer_parts``) nor the sums over ranges (``stage_costs``).
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
import torch

from alpa_torch.core.grad_op import GRAD_MARKER_NAME
from intra_ilp import cost_model as cm
from intra_ilp.reshard_paths import reshard_s

from .layer_parts import bucket_s, bucketed_at_readers, bucketed_edge, latency_s, node_val


class Stitching:
    """The edges between the layers of ``layers`` (a ``LayerAssignment``) and their price."""

    def __init__(self, graph, fx_nodes: dict, layers, sigs):
        self.graph, self.fx_nodes, self.sigs = graph, fx_nodes, sigs
        self.layer_of, self.num_layers = layers.layer_of, layers.num_layers
        self.cross_edges = self._cross_edges()

    def _cross_edges(self) -> list[tuple]:
        """(src, src layer, dst, dst layer, input index or -1, shape, itemsize, phase) of
        every edge between two layers; -1: an updated state back to its stored input; phase
        'gradient': into a gradient marker (reduced in a bucket where the runtime does)."""
        layer_of, out = self.layer_of, []
        for v in self.graph.nodes:
            node = self.fx_nodes[v]
            if node.target is operator.getitem:
                continue
            ins = [a for a in node.all_input_nodes if isinstance(node_val(a), torch.Tensor)]
            for j, a in enumerate(ins):
                la = layer_of.get(a.name)
                if la is not None and la != layer_of[v]:
                    val = node_val(a)
                    facts = self.graph.nodes[v]
                    out.append((a.name, la, v, layer_of[v], j, tuple(val.shape), val.element_size(),
                                "gradient" if facts.target == GRAD_MARKER_NAME else facts.phase))
        stored = {(s.kind, s.name): s.node for s in self.graph.inputs}
        for s in self.graph.outputs:
            dst = stored.get((s.kind, s.name))
            if dst and s.node in layer_of and layer_of[s.node] != layer_of[dst]:
                val = node_val(self.fx_nodes[dst])
                out.append((s.node, layer_of[s.node], dst, layer_of[dst], -1, tuple(val.shape),
                            val.element_size(), "update"))
        return out

    @functools.cached_property
    def _split_markers(self) -> dict[str, list[tuple[str, int, int]]]:
        """Gradient marker -> its readers as (reader, its layer, input index), for every marker
        read in another layer than its own (its optimizer update assigned elsewhere)."""
        layer_of, out = self.layer_of, {}
        for name, facts in self.graph.nodes.items():
            if facts.target != GRAD_MARKER_NAME or name not in layer_of:
                continue
            readers = []
            for user in self.fx_nodes[name].users:
                ins = [a.name for a in user.all_input_nodes if isinstance(node_val(a), torch.Tensor)]
                if user.name in layer_of and name in ins:
                    readers.append((user.name, layer_of[user.name], ins.index(name)))
            if any(layer != layer_of[name] for _, layer, _ in readers):
                out[name] = readers
        return out

    def _bucketed_at_readers(self, layer_costs, mesh, x_up) -> set[tuple[str, str]]:
        """The gradients the plan keeps partial through their marker, read in several layers, that
        the runtime reduces once in a bucket (``layer_parts.bucketed_at_readers``): their bucket in
        ``x_up`` between the marker's layer and its readers', less the readers' reductions the
        marker's own layer priced. Returns the cross-layer edges it replaces."""
        replaced = set()
        for marker, readers in self._split_markers.items():
            lm = self.layer_of[marker]
            spec = self._spec(layer_costs, lm, marker, -1)
            wants = [self._spec(layer_costs, lr, r, j) for r, lr, j in readers]
            if spec is None or not spec.has_partial or any(w is None for w in wants):
                continue
            axes = bucketed_at_readers(spec, wants)
            if axes is None:
                continue
            val = node_val(self.fx_nodes[marker])
            shape, itemsize = tuple(val.shape), val.element_size()
            own = math.fsum(reshard_s(mesh, spec, w, shape, itemsize)
                            for (_, lr, _), w in zip(readers, wants) if lr == lm)
            layers = [lm, *(lr for _, lr, _ in readers)]
            x_up[min(layers), max(layers)] += bucket_s(mesh, spec, axes, shape, itemsize) - own
            replaced |= {(marker, r) for r, lr, _ in readers if lr != lm}
        return replaced

    def _spec(self, layer_costs, layer, name, j):
        sharding = layer_costs[layer].sharding
        rep_name = self.sigs.to_rep[layer].get(name)
        if j < 0:
            return sharding.value_specs.get(rep_name)
        ins = sharding.input_specs.get(rep_name)
        return ins[j] if ins is not None and j < len(ins) else None

    def costs(self, mesh: cm.MeshCost, layer_costs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x_ab (``stage_costs``' docstring) under the layers' solutions ``layer_costs`` (one
        ``LayerCost`` per layer), split into (fb, update), and the collective latency (α) part
        of fb; float64 [L, L], upper triangle."""
        num_layers = self.num_layers
        x_fb, x_up = np.zeros((num_layers, num_layers)), np.zeros((num_layers, num_layers))
        x_lat = np.zeros((num_layers, num_layers))
        replaced = self._bucketed_at_readers(layer_costs, mesh, x_up)
        for src, la, dst, lb, j, shape, itemsize, phase in self.cross_edges:
            if (src, dst) in replaced:
                continue
            spec_src = self._spec(layer_costs, la, src, -1)
            spec_dst = self._spec(layer_costs, lb, dst, j)
            if spec_src is None or spec_dst is None:
                continue
            if phase == "gradient":  # reduced once a step, in a bucket (``layer_parts.bucketed_edges``)
                marker_spec = self._spec(layer_costs, lb, dst, -1)
                axes = bucketed_edge(spec_src, spec_dst, marker_spec) if marker_spec is not None else None
                if axes is not None:
                    x_up[min(la, lb), max(la, lb)] += bucket_s(mesh, marker_spec, axes, shape, itemsize)
                    continue
            cost = reshard_s(mesh, spec_src, spec_dst, shape, itemsize)
            (x_up if phase == "update" else x_fb)[min(la, lb), max(la, lb)] += cost
            if phase != "update" and cost > 0:
                x_lat[min(la, lb), max(la, lb)] += latency_s(mesh, spec_src, spec_dst, shape, itemsize)
        return x_fb, x_up, x_lat
