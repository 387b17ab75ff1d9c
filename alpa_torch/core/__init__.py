"""The bottom layer: plain data and pure functions every other layer reads.

Modules (``docs/architecture.md`` §0 says more of each):

- ``errors``           every exception a user can see
- ``cluster``          ``DeviceSpec``, ``LinkSpec``, ``Cluster``: the hardware a plan is for, its submeshes
- ``options``          ``PlanOptions``: every planner option, validated, spelled once
- ``spec``             ``ShardingSpec`` (``S(0)R``) and its DTensor placements
- ``sharding``         ``StageSharding``: the specs and priced costs of one stage
- ``graph``            ``OpGraph``: the captured step, its inputs, outputs and nodes
- ``graph_facts``      per node: phase, FLOPs, bytes
- ``grad_op``          the ``alpa::grad`` identity that marks final gradients
- ``attention_op``     fused attention as one operator of the graph, and its backward
- ``op_rules``         DTensor sharding rules for operators DTensor has none for
- ``grad_reductions``  where a plan reduces each gradient
- ``plan``             ``ParallelPlan`` / ``StagePlan``: frozen, JSON, a table
- ``microbatches``     which batch leaves are cut into microbatches, and how
- ``partition``        the step split into per-stage programs and the values that cross stages
- ``schedule``         pipeline schedules as objects (order, in-flight memory, step time), a simulator
- ``remat``            activation checkpointing as a graph rewrite

Imports: torch, yaml. Nothing here imports Ray, Pyomo, HiGHS or numba, nor any other package
of the project (``tests/test_layers.py``).
"""
