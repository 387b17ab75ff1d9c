"""The bottom layer: plain data and pure functions every other layer reads.

Errors, the ``Cluster`` a plan is for, the captured ``OpGraph`` and its facts, sharding
specs, the ``ParallelPlan`` and its options, the ``alpa::grad`` marker operator, and the
arithmetic of schedules, stage partitions, microbatches and recomputation. Nothing here
imports Ray, Pyomo, HiGHS or numba, nor anything above this package
(``tests/test_layers.py``).
"""
