"""Where a device's tensors live: the one fact every runtime module asks about a mesh.

A worker owns one device (``worker.DeviceWorker``: a CPU process, or one GPU); tensors made
from wire arrays, batches, buffers for received tiles and the flags of collectives go to
that device. Nothing else in the runtime names a device type.
"""

from __future__ import annotations

import torch


def mesh_device(mesh) -> torch.device:
    """The device the tensors of ``mesh`` (a ``DeviceMesh``) live on in this process: its device
    type, and for an accelerator the process's current one."""
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())
