"""The runtime's debugging switches: environment variables, each on unless set to 0.

Each turns off one mechanism so that a user (or a test) can tell whether it is the cause of
a problem; none changes what a step computes.
"""

from __future__ import annotations

import os

REPLAY_ENV = "ALPA_TORCH_REPLAY"
"""``ALPA_TORCH_REPLAY=0`` in a worker's environment: every step runs every operator through DTensor
(read when a runner is made, ``interpreter.StageRunner``)."""
DONATE_ENV = "ALPA_TORCH_DONATE"
"""``ALPA_TORCH_DONATE=0`` in a worker's environment: no operator runs in place on a dead input
(``donation.py``; read when a runner is made)."""
P2P_TAGS_ENV = "ALPA_TORCH_P2P_TAGS"
"""``ALPA_TORCH_P2P_TAGS=0`` in a worker's environment: every point-to-point message carries tag 0,
as under NCCL, which ignores tags and matches the messages between two ranks by the order both
post them; a plan that equals eager so does not depend on its tags (``comm.wire_tag``; read when
``comm`` is imported)."""
WORKER_SWITCHES = (REPLAY_ENV, DONATE_ENV, P2P_TAGS_ENV)
"""The switches a worker reads: set in the driver's environment, they reach the workers
(``worker.actor_env``)."""
EARLY_ANSWER_ENV = "ALPA_TORCH_EARLY_ANSWER"
"""``ALPA_TORCH_EARLY_ANSWER=0`` in the driver's environment: a step returns only when every worker
has finished its update, so an error in a backward is raised by the step that ran it
(``worker.DeviceWorker.run_early``; read at each step, ``engine.Engine.step``)."""


def switch_on(name: str) -> bool:
    """Whether switch ``name`` is on: unless the environment sets it to 0."""
    return os.environ.get(name, "1") != "0"


__all__ = ["DONATE_ENV", "EARLY_ANSWER_ENV", "P2P_TAGS_ENV", "REPLAY_ENV", "WORKER_SWITCHES", "switch_on"]
