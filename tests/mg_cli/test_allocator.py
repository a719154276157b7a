"""keep_freed_memory: a large tensor allocated and freed step after step costs no page faults inside once the
steps are in their steady state (from the fourth allocation on), and every time outside."""

from __future__ import annotations

import resource

import pytest
import torch

from mg_cli.training.allocator import _glibc, keep_freed_memory

MIB = 2**20


def _faults_per_cycle(numel: int, cycles: int) -> list[int]:
    """Page faults of each of ``cycles`` allocate-fill-free cycles of a tensor of ``numel`` fp32 values (what a
    training step does with its large temporaries)."""
    out = []
    for _ in range(cycles):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(numel).fill_(2.0)
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return out


@pytest.mark.skipif(_glibc() is None, reason="the setting is glibc's (Linux)")
def test_freed_memory_is_reused_inside_and_returned_after() -> None:
    numel = 64 * MIB // 4  # above glibc's largest mmap threshold (32 MiB): always a fresh mmap by default
    pages = 64 * MIB // resource.getpagesize()
    default = _faults_per_cycle(numel, 3)  # every page faults again (fewer with transparent huge pages)
    with keep_freed_memory() as active:
        assert active
        inside = _faults_per_cycle(numel, 6)
    # A reallocation may not fit the freed block (posix_memalign asks for more than its size): one of the second
    # and third cycles may extend the heap, and from the fourth on every cycle reuses what the last one freed.
    assert sum(f >= pages // 2 for f in inside[1:3]) <= 1, inside
    assert all(f < pages // 100 for f in inside[3:]), inside
    after = _faults_per_cycle(numel, 2)
    assert all(f > min(min(default), pages) // 2 for f in after), (default, after)  # glibc's limits again


def test_disabled_leaves_the_allocator_alone() -> None:
    with keep_freed_memory(enabled=False) as active:
        assert not active
