"""How much memory a device's worker holds, measured in the worker, and giving freed memory back.

A plan promises that its stages fit the device (``stage_dp.memory_sim``). The simulation
counts the plan's tensors; a worker also holds the runtime's own memory (its graph and
programs, the process groups' buffers, the state it received) and whatever the allocator
keeps of freed memory. Measured plan selection (``alpa_torch.tune``) therefore measures
each candidate's peak here, and keeps none whose own part of it is over the device.

What "the memory a device holds" is, per device type:

- **GPU**: ``torch.cuda.max_memory_reserved`` since the deployment started (the caching
  allocator's high-water mark, the figure an out-of-memory error is about);
- **CPU** (a virtual device is a process): the process's peak resident set (``VmHWM``)
  since the deployment started, above its resident set when it had joined the process
  group (``started_bytes``), the measure ``bench/vs_pytorch.py`` holds every system to.
  The peak is reset by writing 5 to ``/proc/self/clear_refs`` (Linux 4.0+); where that
  is not possible the peak counts from the worker's start.

``release_freed`` gives the memory a dropped deployment freed back (glibc's ``malloc_trim``
on CPU, ``torch.cuda.empty_cache`` on GPU) and resets the peak, so the next deployment's
peak is its own, plus what earlier ones left that cannot be given back (on CPU: modules
imported, the state received through Ray's object store, heap pages still partly in use;
~160 MB after the wide GPT's one-stage trial on 1x4). ``lifetime_peak_bytes`` is the
process's peak across those resets (``bench/vs_pytorch.py`` reads it where it reads the
peers' ``VmHWM``). ``keep_freed_memory`` is the opposite setting, for the steps of one
deployment, and ``heap_in_use_bytes`` the live heap, without what the allocator keeps.
"""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger(__name__)

_peak_before_reset = 0.0
"""This process's peak (``_peak_now``) when ``release_freed`` last reset it: a reset loses the
kernel's (or the caching allocator's) lifetime figure, kept here for ``lifetime_peak_bytes``."""


def _libc():
    """glibc, or None (another C library: nothing to tune)."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> None:
    """Worker processes: let glibc reuse freed memory instead of giving it back to the OS.

    The runtime frees every value after its last reader; with glibc's default
    (dynamic) thresholds the freed top of the heap and large blocks go back to the
    kernel and the next step faults every page in again: 3,000-11,000 minor faults
    and +0.03 s of system time per step and device on the GPT benchmark, none for
    DDP. Blocks up to 32 MiB (glibc's maximum) come from the heap, and the heap is
    trimmed only above 1 GiB free. Not glibc (``mallopt`` missing): nothing to do."""
    libc = _libc()
    try:
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    except AttributeError:
        log.debug("mallopt unavailable: allocator left as is")


def heap_in_use_bytes() -> float | None:
    """Bytes glibc's malloc has handed out and not got back (every arena, mmapped blocks
    included): the live heap, without the freed pages RSS keeps (``keep_freed_memory``).
    None without glibc's ``mallinfo2``."""

    class _MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = _libc()
    try:
        libc.mallinfo2.restype = _MallInfo2
    except AttributeError:
        return None
    info = libc.mallinfo2()
    return float(info.uordblks + info.hblkhd)


def status_bytes(key: str) -> float | None:
    """A size line of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def started_bytes(device: torch.device) -> float:
    """What the worker holds before any plan (called once it has joined the process group): the
    process's resident set on CPU (0 where unknown), 0 on GPU (nothing of the plan is reserved)."""
    if device.type == "cuda":
        return 0.0
    return status_bytes("VmRSS") or 0.0


def release_freed(device: torch.device) -> None:
    """Give the memory freed so far back (after a deployment is dropped), then start a new peak
    (the process's peak so far is kept for ``lifetime_peak_bytes``)."""
    global _peak_before_reset
    _peak_before_reset = max(_peak_before_reset, _peak_now(device))
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return
    libc = _libc()
    try:
        libc.malloc_trim(0)
    except AttributeError:
        log.debug("malloc_trim unavailable: freed memory stays with the process")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
    except OSError:
        log.debug("cannot reset the peak resident set: the peak counts from the worker's start")


def _peak_now(device: torch.device) -> float:
    """The peak since the last reset, in absolute bytes (0 where unknown)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_reserved(device))
    return status_bytes("VmHWM") or 0.0


def peak_bytes(device: torch.device, started: float) -> float:
    """The most this device held since ``release_freed`` (GPU: reserved by the caching allocator;
    CPU: the peak resident set above ``started``, ``started_bytes``); 0 where unknown."""
    return max(_peak_now(device) - started, 0.0)


def lifetime_peak_bytes(device: torch.device) -> float:
    """The most this device held since the process started, across ``release_freed``'s resets
    (absolute bytes: ``VmHWM`` as if never reset on CPU, the peak reserve on GPU)."""
    return max(_peak_before_reset, _peak_now(device))


__all__ = ["heap_in_use_bytes", "keep_freed_memory", "lifetime_peak_bytes", "peak_bytes", "release_freed",
           "started_bytes", "status_bytes"]
