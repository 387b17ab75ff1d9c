"""``runtime/device_memory.py`` in this process (a CPU device): a peak counts from the last
release, the release gives freed heap memory back, and the process's lifetime peak survives it."""

from __future__ import annotations

import os

import pytest
import torch

from runtime.device_memory import (
    heap_in_use_bytes,
    keep_freed_memory,
    lifetime_peak_bytes,
    peak_bytes,
    release_freed,
    started_bytes,
)

MiB = 2**20


@pytest.mark.skipif(heap_in_use_bytes() is None or not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs glibc and a writable /proc/self/clear_refs (Linux)")
def test_a_peak_counts_from_the_last_release_and_the_release_gives_freed_memory_back():
    cpu = torch.device("cpu")
    keep_freed_memory()  # as a worker runs: freed blocks stay with the process until released
    started = started_bytes(cpu)
    assert started > 0
    release_freed(cpu)
    blocks = [torch.ones(2**18) for _ in range(192)]  # 192 blocks of 1 MiB from the heap, each touched
    held = peak_bytes(cpu, started)
    assert held >= 150 * MiB, held / MiB
    del blocks
    assert peak_bytes(cpu, started) >= held  # freed, but the peak stays (the heap keeps the pages)
    release_freed(cpu)
    assert peak_bytes(cpu, started) < held - 100 * MiB, (held / MiB, peak_bytes(cpu, started) / MiB)
    assert lifetime_peak_bytes(cpu) >= started + held  # the process's peak survives the reset


def test_without_a_cpu_peak_the_measure_is_zero_not_an_error(monkeypatch):
    import runtime.device_memory as dm

    monkeypatch.setattr(dm, "status_bytes", lambda key: None)
    assert dm.started_bytes(torch.device("cpu")) == 0.0 and dm.peak_bytes(torch.device("cpu"), 0.0) == 0.0
