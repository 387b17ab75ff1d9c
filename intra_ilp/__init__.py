"""The sharding ILP of a stage (Alpa §4): which sharding each operator takes on a logical mesh.

Modules, bottom-up (``docs/architecture.md`` §2 says more of each):

- ``strategies``     each operator's strategies, from DTensor's sharding rules (fake process group)
- ``cost_model``     roofline compute, alpha-beta collectives, bytes per device
- ``reshard_paths``  the cheapest collectives from one sharding to another, priced by ``cost_model``
- ``instance``       ``ILPInstance``: the ILP as data
- ``reduce``         exact reductions of an instance (followers, ties, dominance, elimination)
- ``rounding``       LP rounding, diving, local improvement
- ``highs_direct``   the Pyomo model handed to HiGHS as one sparse matrix
- ``ilp``            the Pyomo model, each constraint family named, and its solve
- ``stage``          a graph (or a stage of it) to an ``ILPInstance``, its solution to a ``StageSharding``
- ``solve``          ``python -m intra_ilp.solve INSTANCE``: one saved instance solved

Imports: ``alpa_torch.core``, torch, numpy, pyomo, highspy. Never ``stage_dp``, ``runtime`` or the
public face (``tests/test_layers.py``).
"""
