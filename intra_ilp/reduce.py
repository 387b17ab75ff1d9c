"""Exact model reductions that turn an ``ILPInstance`` into a smaller ``ReducedProblem``.

Input: an ``ILPInstance`` (see ``instance.py``). Output: a ``ReducedProblem``
over *groups* of original nodes, which ``ilp.py`` turns into a Pyomo model,
plus an ``Expansion`` that maps a choice for the reduced variables back to one
strategy index per original node. Nothing here solves an LP.

Every reduction keeps at least one optimal solution (and the optimal value):

(a) Followers, ``s_f = map[s_l]``: the follower's group is merged into the
    leader's. In general two groups ``A``, ``B`` joined by a relation ``R``
    become one group whose strategies are the pairs ``(a, b) in R``; node
    costs add (``c(a, b) = c_A(a) + c_B(b)``), edges to a third group are
    re-indexed by the pair's component, an edge between ``A`` and ``B``
    becomes a node cost ``M[a, b]``, memory coefficients add per liveness
    point. For a follower the pairs are ``(map[b], b)`` over the allowed
    leader strategies ``b``, so the group keeps the leader's size.
(b) Tie groups, ``s_u = s_v``: the same merge with the identity relation, so
    a group of repeated layers is one variable whose cost is the sum, edges
    between two tied groups are summed (parallel edges), an edge inside a
    group lands on the diagonal, and a liveness point listing several members
    gets the summed (multiplicity) coefficient.
(c) Strategy ``s`` of a group is dropped if another strategy ``t`` is no worse
    everywhere: node cost, every entry of every incident edge row and every
    memory coefficient (``F[s] >= F[t]`` componentwise, ties broken by index).
    Swapping ``s`` for ``t`` in any solution changes no other term, so an
    optimum survives. A group left with one strategy is fixed: its edges fold
    into the neighbours' node costs, its memory into the points' constants.
(d) Parallel edges are summed; an edge with ``M[a, b] = f(a) + g(b)``
    (separable, e.g. constant) folds into the two node costs.
(e) A group with no memory coefficient and at most two neighbours is
    eliminated exactly (variable elimination / dynamic programming):
    ``c'_y(b) += min_a c_x(a) + M_xy[a, b]``, or for two neighbours a new edge
    ``M'_yz[b, c] = min_a c_x(a) + M_xy[a, b] + M_xz[a, c]`` (only when it
    adds no more edge variables than it removes); the argmin table is kept.
Memory points are pruned first: a point that cannot bind under the budget
(constant plus every term's maximum fits) is dropped, and so is a point
dominated by another (smaller constant, subset of groups, smaller
coefficients). With ``min_peak=True`` (the min-peak-memory ILP) the budget is
ignored and only dominated points are dropped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from intra_ilp.instance import ILPInstance

log = logging.getLogger(__name__)


class ContradictoryConstraintsError(ValueError):
    """Followers / tie groups admit no strategy at all for some node."""


@dataclass(frozen=True, slots=True, eq=False)
class MemoryRow:
    """``constant_bytes + sum_(var, coef) coef[s_var] <= budget`` (one kept liveness point)."""

    point: int
    """Index of the liveness point in the original instance."""
    constant_bytes: float
    terms: tuple[tuple[int, np.ndarray], ...]
    """(reduced variable, bytes per strategy) pairs."""


@dataclass(frozen=True, slots=True, eq=False)
class Expansion:
    """Maps reduced choices back to original nodes (see ``ReducedProblem.expand``)."""

    node_group: np.ndarray
    """int [n]: the group each original node belongs to."""
    node_table: tuple[np.ndarray, ...]
    """per node: group strategy index -> the node's own strategy index."""
    var_group: tuple[int, ...]
    """the group behind each reduced variable."""
    var_keep: tuple[np.ndarray, ...]
    """per variable: its strategy index -> group strategy index."""
    eliminated: tuple[tuple[int, tuple[int, ...], np.ndarray], ...]
    """(group, neighbour groups, table over neighbours' group strategies), in elimination order."""
    num_groups: int


@dataclass(frozen=True, slots=True, eq=False)
class ReducedProblem:
    """The ILP ``ilp.py`` builds: variables with k strategies, costs, edges, memory rows."""

    num_strategies: tuple[int, ...]
    cost_s: tuple[np.ndarray, ...]
    """per variable: objective per strategy (compute + comm + folded reshard; the parts are
    recomputed from the original instance after expansion, since eliminated terms mix them)."""
    edges: tuple[tuple[int, int, np.ndarray], ...]
    """(a, b, reshard_s [k_a, k_b]) with a < b."""
    memory_rows: tuple[MemoryRow, ...]
    memory_budget_bytes: float
    links: tuple[tuple[int, int, np.ndarray], ...]
    """(follower var, leader var, mapping) kept as constraints (only when not reduced)."""
    offset_s: float
    """objective of everything folded away."""
    expansion: Expansion

    def expand(self, choice: Sequence[int]) -> tuple[int, ...]:
        """Strategy index of every original node, from one index per reduced variable."""
        ex = self.expansion
        sel = np.full(ex.num_groups, -1, dtype=np.int64)
        for i, g in enumerate(ex.var_group):
            sel[g] = ex.var_keep[i][choice[i]]
        for g, nbrs, table in reversed(ex.eliminated):
            assert all(sel[n] >= 0 for n in nbrs), "eliminated group expanded before its neighbours"
            sel[g] = table[tuple(sel[n] for n in nbrs)]
            assert sel[g] >= 0, "elimination table hit a strategy removed earlier"
        return tuple(int(ex.node_table[v][sel[g]]) for v, g in enumerate(ex.node_group))


class _Work:
    """Mutable factor graph the reductions rewrite: groups, node costs, edges, memory rows."""

    def __init__(self, inst: ILPInstance, with_rows: bool):
        n = len(inst.nodes)
        self.group = np.arange(n)
        self.members = {v: [v] for v in range(n)}
        self.table = [np.arange(k) for k in inst.num_strategies]
        self.cost = {v: node.compute_s + node.comm_s for v, node in enumerate(inst.nodes)}
        self.adj: dict[int, dict[int, np.ndarray]] = {v: {} for v in range(n)}
        self.rows: dict[int, dict[int, np.ndarray]] = {}
        self.rconst: dict[int, float] = {}
        self.offset = 0.0
        self.eliminated: list[tuple[int, tuple[int, ...], np.ndarray]] = []
        for e in inst.edges:
            self.add_edge(e.src, e.dst, e.reshard_s)
        if with_rows:
            for t, live in enumerate(inst.liveness):
                self.rconst[t], self.rows[t] = inst.constant_memory_bytes, {}
                for v in live:
                    self.rows[t][v] = self.rows[t].get(v, 0.0) + inst.nodes[v].memory_bytes
        self.root_rows = {v: set() for v in range(n)}
        for t, terms in self.rows.items():
            for r in terms:
                self.root_rows[r].add(t)
        self.keep = {v: np.arange(k) for v, k in enumerate(inst.num_strategies)}
        self.frozen_tables = False
        self.undominated: dict[int, list[np.ndarray]] = {}
        """group -> its feature arrays when ``_drop_dominated`` last found nothing to drop."""
        self.not_separable: dict[int, np.ndarray] = {}
        """id -> edge matrix (or its transpose) ``_fold_separable`` found not separable."""

    def k(self, r: int) -> int:
        return len(self.cost[r])

    def add_edge(self, a: int, b: int, m: np.ndarray) -> None:
        """Add ``m`` [k_a, k_b] to the edge between groups a and b (a == b: its diagonal)."""
        if a == b:
            self.cost[a] = self.cost[a] + np.diagonal(m)
            return
        old = self.adj[a].get(b)
        new = m if old is None else old + m
        self.adj[a][b], self.adj[b][a] = new, new.T

    def drop_edge(self, a: int, b: int) -> np.ndarray:
        del self.adj[b][a]
        return self.adj[a].pop(b)

    def restrict(self, r: int, idx: np.ndarray) -> None:
        """Keep only strategies ``idx`` of group r."""
        if len(idx) == 0:
            raise ContradictoryConstraintsError(
                f"followers / tie groups leave no strategy for nodes {self.members[r][:8]}")
        if not self.frozen_tables:  # after phase 1, tables stay in the groups' phase-1 indices
            for v in self.members[r]:
                self.table[v] = self.table[v][idx]
        self.cost[r], self.keep[r] = self.cost[r][idx], self.keep[r][idx]
        for x, m in self.adj[r].items():
            self.adj[r][x] = m[idx]
            self.adj[x][r] = self.adj[r][x].T
        for t in self.root_rows[r]:
            self.rows[t][r] = self.rows[t][r][idx]

    def merge(self, r1: int, r2: int, a: np.ndarray, b: np.ndarray) -> int:
        """Replace groups r1, r2 by one whose strategies are the pairs (a[p], b[p])."""
        if len(a) == 0:
            raise ContradictoryConstraintsError(
                f"followers / tie groups leave no strategy for nodes {(self.members[r1] + self.members[r2])[:8]}")
        if len(self.members[r1]) < len(self.members[r2]):
            r1, r2, a, b = r2, r1, b, a
        inner = self.adj[r1].get(r2)
        if inner is not None:
            self.drop_edge(r1, r2)
        self.restrict(r1, a)
        self.cost[r1] = self.cost[r1] + self.cost.pop(r2)[b] + (inner[a, b] if inner is not None else 0.0)
        for v in self.members[r2]:
            self.table[v] = self.table[v][b]
            self.group[v] = r1
        self.members[r1] += self.members.pop(r2)
        for x in list(self.adj[r2]):
            self.add_edge(r1, x, self.drop_edge(r2, x)[b])
        del self.adj[r2], self.keep[r2]
        for t in self.root_rows.pop(r2):
            coef = self.rows[t].pop(r2)[b]
            self.rows[t][r1] = self.rows[t][r1] + coef if r1 in self.rows[t] else coef
            self.root_rows[r1].add(t)
        return r1

    def relate(self, f: int, l: int, mapping: np.ndarray) -> None:
        """Impose ``s_f == mapping[s_l]`` (reduction a, and b with the identity mapping)."""
        rf, rl = self.group[f], self.group[l]
        target = mapping[self.table[l]]  # per strategy of rl: f's required strategy, or -1
        if rf == rl:
            self.restrict(rf, np.nonzero(self.table[f] == target)[0])
            return
        a, b = np.nonzero(self.table[f][:, None] == target[None, :])
        self.merge(rf, rl, a, b)

    def remove_group(self, r: int, nbrs: tuple[int, ...], table: np.ndarray) -> None:
        """Record group r as eliminated (its strategy follows from ``nbrs``) and delete it."""
        self.eliminated.append((r, nbrs, table))
        for x in list(self.adj[r]):
            self.drop_edge(r, x)
        for t in self.root_rows.pop(r):
            del self.rows[t][r]
        del self.adj[r], self.cost[r]


def _prune_rows(w: _Work, budget: float | None) -> bool:
    """Drop memory points that cannot bind (under ``budget``) or are dominated. True if any."""
    order, dropped = [], []
    for t, terms in w.rows.items():
        hi = w.rconst[t] + sum(float(c.max()) for c in terms.values())
        if budget is not None and hi <= budget:
            dropped.append(t)
        else:
            order.append((-hi, t))
    kept: set[int] = set()
    for _, t in sorted(order):
        terms = w.rows[t]
        cands = set(kept) if not terms else set.intersection(*(w.root_rows[r] for r in terms)) & kept
        if any(w.rconst[j] >= w.rconst[t] and all(np.all(w.rows[j][r] >= c) for r, c in terms.items())
               for j in cands):
            dropped.append(t)
        else:
            kept.add(t)
    for t in dropped:
        for r in w.rows.pop(t):
            w.root_rows[r].discard(t)
        del w.rconst[t]
    return bool(dropped)


def _drop_dominated(w: _Work, r: int) -> bool:
    """Reduction (c) on group r. True if a strategy was dropped."""
    if w.k(r) == 1:
        return False
    parts = [w.cost[r]] + list(w.adj[r].values()) + [w.rows[t][r] for t in w.root_rows[r]]
    seen = w.undominated.get(r)
    if seen is not None and len(seen) == len(parts) and all(a is b for a, b in zip(seen, parts)):
        return False  # the same arrays as when nothing was dominated
    f = np.hstack([p if p.ndim == 2 else p[:, None] for p in parts])
    ge = np.all(f[:, None, :] >= f[None, :, :], axis=2)  # ge[s, t]: s no better than t
    eq = ge & ge.T
    idx = np.arange(w.k(r))
    worse = ge & (~eq | (idx[:, None] > idx[None, :]))
    np.fill_diagonal(worse, False)
    bad = worse.any(axis=1)
    if bad.any():
        w.restrict(r, np.nonzero(~bad)[0])
        return True
    w.undominated[r] = parts
    return False


def _fold_separable(w: _Work, r: int) -> bool:
    """Reduction (d): fold edges ``M[a, b] = f(a) + g(b)`` of group r into node costs."""
    changed = False
    for x, m in list(w.adj[r].items()):
        if w.not_separable.get(id(m)) is m:  # checked before, unchanged since
            continue
        sep = m[:, :1] + m[:1, :] - m[0, 0]
        # np.allclose(m, sep, rtol=0, atol=tol) without its overhead (finite values)
        if float(np.abs(m - sep).max()) <= 1e-12 * max(1.0, float(np.abs(m).max())):
            w.drop_edge(r, x)
            w.cost[r] = w.cost[r] + m[:, 0]
            w.cost[x] = w.cost[x] + (m[0, :] - m[0, 0])
            changed = True
        else:
            rev = w.adj[x][r]  # the stored transpose: separable iff m is
            w.not_separable[id(m)], w.not_separable[id(rev)] = m, rev
    return changed


def _eliminate(w: _Work, x: int, k1: dict[int, int]) -> bool:
    """Reduction (e): eliminate a memory-free group with at most two neighbours."""
    if w.root_rows[x]:
        return False
    nbrs = tuple(w.adj[x])
    cx, keep = w.cost[x], w.keep[x]
    if len(nbrs) == 0:
        a = int(np.argmin(cx))
        w.offset += float(cx[a])
        w.remove_group(x, (), np.array(keep[a]))
        return True
    if len(nbrs) == 1:
        (y,) = nbrs
        tot = cx[:, None] + w.adj[x][y]
        table = np.full(k1[y], -1)
        table[w.keep[y]] = keep[tot.argmin(axis=0)]
        w.cost[y] = w.cost[y] + tot.min(axis=0)
        w.remove_group(x, nbrs, table)
        return True
    if len(nbrs) == 2:
        y, z = nbrs
        if z not in w.adj[y] and w.k(y) * w.k(z) > w.k(x) * (w.k(y) + w.k(z)):
            return False
        tot = cx[:, None, None] + w.adj[x][y][:, :, None] + w.adj[x][z][:, None, :]
        table = np.full((k1[y], k1[z]), -1)
        table[np.ix_(w.keep[y], w.keep[z])] = keep[tot.argmin(axis=0)]
        w.remove_group(x, nbrs, table)
        w.add_edge(y, z, tot.min(axis=0))
        return True
    return False


def _fix_single(w: _Work, r: int) -> bool:
    """A group with one strategy left: fold its edges and memory away (reduction c)."""
    if w.k(r) != 1:
        return False
    for x in list(w.adj[r]):
        w.cost[x] = w.cost[x] + w.drop_edge(r, x)[0]
    for t in list(w.root_rows[r]):
        w.rconst[t] += float(w.rows[t][r][0])
    w.offset += float(w.cost[r][0])
    w.remove_group(r, (), np.array(w.keep[r][0]))
    return True


def _simplify(w: _Work, budget: float | None) -> None:
    k1 = {r: w.k(r) for r in w.cost}
    for r in w.cost:
        w.keep[r] = np.arange(w.k(r))
    w.frozen_tables = True
    changed = True
    while changed:
        changed = _prune_rows(w, budget)
        for r in list(w.cost):
            if r not in w.cost:
                continue
            changed |= _fold_separable(w, r)
            changed |= _drop_dominated(w, r)
            changed |= _fix_single(w, r) or _eliminate(w, r, k1)


def reduce_instance(inst: ILPInstance, *, reductions: bool = True, min_peak: bool = False) -> ReducedProblem:
    """Build the problem ``ilp.py`` solves.

    ``reductions=False`` keeps one variable per node and writes followers and
    tie groups as ``links`` constraints (the direct model). ``min_peak=True``
    keeps every non-dominated memory point whatever the budget (for the
    min-peak-memory ILP); otherwise an infinite budget drops all of them.
    """
    budget = None if min_peak else inst.memory_budget_bytes
    w = _Work(inst, with_rows=min_peak or not math.isinf(inst.memory_budget_bytes))
    links = []
    relations = [(f.follower, f.leader, f.mapping) for f in inst.followers]
    for g in inst.tie_groups:
        relations += [(v, g[0], np.arange(inst.nodes[v].num_strategies)) for v in g[1:]]
    if reductions:
        for f, l, mapping in relations:
            w.relate(f, l, mapping)
        _simplify(w, budget)
    else:
        links = [(f, l, np.asarray(m)) for f, l, m in relations]
        if budget is not None:
            _prune_rows(w, budget)
    return _export(w, links, inst, budget)


def _export(w: _Work, links: list, inst: ILPInstance, budget: float | None) -> ReducedProblem:
    groups = sorted(w.cost)
    var = {g: i for i, g in enumerate(groups)}
    edges = tuple((var[a], var[b], m) for a in groups for b, m in w.adj[a].items() if var[a] < var[b])
    rows = tuple(MemoryRow(t, w.rconst[t], tuple((var[r], c) for r, c in sorted(w.rows[t].items()) if c.any()))
                 for t in sorted(w.rows))
    ex = Expansion(node_group=w.group.copy(), node_table=tuple(w.table), var_group=tuple(groups),
                   var_keep=tuple(w.keep[g] for g in groups), eliminated=tuple(w.eliminated),
                   num_groups=len(w.group))
    links = tuple((var[f], var[l], m) for f, l, m in links)
    prob = ReducedProblem(num_strategies=tuple(w.k(g) for g in groups), cost_s=tuple(w.cost[g] for g in groups),
                          edges=edges, memory_rows=rows, memory_budget_bytes=math.inf if budget is None else budget,
                          links=links, offset_s=w.offset, expansion=ex)
    log.info("reduced %d nodes / %d edges / %d points to %d vars / %d edges / %d rows (%d eliminated)",
             len(inst.nodes), len(inst.edges), len(inst.liveness), len(groups), len(edges), len(rows),
             len(w.eliminated))
    return prob
