"""Execution on Ray: one worker per device runs its part of a plan; profiling and checkpoints.

Modules, bottom-up (``docs/architecture.md`` §4 says more of each):

- ``ray_env``         starting or joining Ray, each worker's resources
- ``discovery``       ``cluster_from_ray()``: a running Ray cluster as a ``Cluster``
- ``devices``         where a device's tensors live
- ``wire``            tensors across Ray as numpy, bit for bit
- ``rng``             random operators seeded per operator, step, microbatch and shard
- ``switches``        the debugging switches (``ALPA_TORCH_REPLAY``, ``ALPA_TORCH_DONATE``, ``ALPA_TORCH_P2P_TAGS``,
  ``ALPA_TORCH_EARLY_ANSWER``)
- ``device_memory``   the memory a device's worker holds, freed memory given back
- ``worker``          ``DeviceWorker``: one device's actor, its process group and state
- ``group``           ``WorkerGroup``: the actors, calls with timeouts, failures as ``WorkerError``
- ``program``         graph records compiled into steps with liveness
- ``regions``         runs of local kernels compiled by Inductor (``compile=True``)
- ``codegen``         a settled program as one generated Python function
- ``replay``          operators replayed as the local kernels DTensor's rules imply
- ``donation``        elementwise operators in place on dead inputs
- ``grad_buckets``    gradient reductions in flat buckets
- ``interpreter``     ``StageRunner``: a device's program on DTensors, its state
- ``loss_parts``      a loss left partial over a mesh: each device's part, the driver's sum
- ``resharding``      which tiles go where between two shardings (pure)
- ``comm``            moving those tiles
- ``pipeline``        ``PipelineRunner``: a device's pipelined step, gradient accumulation
- ``timeline``        when each phase, transfer and wait of a worker's step ran
- ``engine``          ``Engine``: a plan deployed, stepped, saved, gathered
- ``state_moves``     state moved between two deployments on the same workers
- ``evaluation``      ``EvalEngine``: a forward-only program beside the training step's
- ``checkpoint``      sharded checkpoints (safetensors and a manifest), resharded on load
- ``state_sources``   where a worker reads its slices of the initial state
- ``profile_fit``     alpha-beta fits of collective timings
- ``profile``         ``profile_cluster()``: measure the workers, calibrate the cluster

Imports: ``alpa_torch.core``, torch, numpy, ray, safetensors. Never ``intra_ilp``, ``stage_dp`` or
the public face (``tests/test_layers.py``): the workers run a plan, they do not make one.
"""
