"""``StageSharding``: the intra-op plan of one stage, as data.

What ``intra_ilp`` decides for a stage on one logical mesh: a ``ShardingSpec`` for every
value and for every operator input, and the costs the ILP priced them at. The plan
stores it as JSON; the runtime reads its specs; ``build`` assembles it from a solved
instance (``intra_ilp.stage`` and ``stage_dp.stage_costs`` both call it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import ShardingSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSharding:
    """The intra-op plan of one stage on one logical mesh."""

    mesh_shape: tuple[int, int]
    value_specs: dict
    """value (fx node) name -> spec of its (first) tensor output."""
    input_specs: dict
    """operator name -> spec of each unique tensor input (``all_input_nodes`` order)."""
    compute_s: float
    comm_s: float
    reshard_s: float
    persistent_bytes: float
    """Per device: parameters, optimizer state, buffers, gradients."""
    activation_bytes: float
    """Per device and microbatch in flight: forward values kept for backward."""
    solver_status: str = "optimal"
    gap: float = 0.0
    build_s: float = 0.0
    solve_s: float = 0.0
    num_vars: int = 0
    num_constraints: int = 0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.reshard_s

    def memory_bytes(self, in_flight: int = 1) -> float:
        return self.persistent_bytes + in_flight * self.activation_bytes

    def to_dict(self) -> dict:
        d = {f: getattr(self, f) for f in self.__slots__ if f not in ("value_specs", "input_specs")}
        d["mesh_shape"] = list(self.mesh_shape)
        d["value_specs"] = {k: str(v) for k, v in self.value_specs.items()}
        d["input_specs"] = {k: [str(s) for s in v] for k, v in self.input_specs.items()}
        return d

    @staticmethod
    def from_dict(d: dict) -> StageSharding:
        d = dict(d)
        d["mesh_shape"] = tuple(d["mesh_shape"])
        d["value_specs"] = {k: ShardingSpec.parse(v) for k, v in d["value_specs"].items()}
        d["input_specs"] = {k: tuple(ShardingSpec.parse(s) for s in v) for k, v in d["input_specs"].items()}
        return StageSharding(**d)
