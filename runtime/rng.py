"""Random operators on the devices: each one seeded by what it is, not by what ran before it.

A random operator (dropout, ``rand``, ``bernoulli`` ...) of the planned step runs with
the default generator seeded from (the user's seed, the step number, the microbatch,
the operator's name, the device's coordinates on the mesh axes that shard its output):

- devices holding the same part of the output (replicas) draw the same numbers, so a
  replicated value stays the same on every device;
- devices holding different parts draw different numbers: no two shards of a mask are
  the same;
- a run is reproducible: the same seed and the same plan give the same numbers, on any
  number of restarts, whatever else drew random numbers in between.

What is not promised: the numbers eager PyTorch draws on one device (they depend on the
order every random operator of the step consumes one generator, which a split step cannot
reproduce), or the same numbers under another plan. The distribution is the same.

DTensor's own generator tracker, which would give one device's numbers, runs on CUDA
meshes only (``torch.distributed.tensor._random.is_rng_supported_mesh``); this scheme
runs the same on every device type.
"""

from __future__ import annotations

import hashlib

import torch

from alpa_torch.core.remat import COPY_SUFFIX

RANDOM_TAG = torch.Tag.nondeterministic_seeded


def is_random(target) -> bool:
    """Whether ``target`` (an ``OpOverload``) draws from a random generator."""
    return isinstance(target, torch._ops.OpOverload) and RANDOM_TAG in target.tags


def op_seed(seed: int, step: int, microbatch: int, name: str, coords: tuple[int, ...]) -> int:
    """A 63-bit seed for operator ``name`` (a recomputed copy shares its original's) on a device
    at ``coords`` (its index on each mesh axis that shards the output, 0 elsewhere)."""
    name = name.split(COPY_SUFFIX)[0]
    key = repr((int(seed), int(step), int(microbatch), name, tuple(int(c) for c in coords))).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class RandomStream:
    """The seeding state of one device: the user's seed, the step and microbatch running now."""

    __slots__ = ("seed", "step", "microbatch")

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.step = 0
        self.microbatch = 0

    def begin_step(self) -> None:
        self.step += 1
        self.microbatch = 0

    def restart(self) -> None:
        """Count steps from a new deployment's start again: the next step seeds as the first."""
        self.step = self.microbatch = 0

    def seed_op(self, name: str, coords: tuple[int, ...]) -> None:
        """Seed the default generators (every device type) for operator ``name`` about to run."""
        torch.manual_seed(op_seed(self.seed, self.step, self.microbatch, name, coords))
