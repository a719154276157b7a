"""The multi-process harness: results by rank, and bounded, named failures."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from mg_parallel.testing import RankDied, RankFailed, RankTimeout, run_distributed


def _all_reduce_rank() -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _raise_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()


def _die_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _hang_on_rank_1() -> None:
    if dist.get_rank() == 1:
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)


def _env() -> tuple[str, str, str]:
    return os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_by_rank(world_size):
    results = run_distributed(_all_reduce_rank, world_size)
    total = world_size * (world_size + 1) / 2
    assert results == [(r, world_size, total) for r in range(world_size)]


def test_environment_is_set():
    assert run_distributed(_env, 2) == [("0", "0", "2"), ("1", "1", "2")]


def test_raising_rank_is_named_with_traceback():
    with pytest.raises(RankFailed, match=r"rank 1 of 2 raised") as info:
        run_distributed(_raise_on_rank_1, 2, timeout=60)
    assert "boom from rank one" in str(info.value)
    # The pool was replaced: the next call works.
    assert run_distributed(_all_reduce_rank, 2)[0] == (0, 2, 3.0)


def test_crashed_rank_is_reported_within_bound():
    start = time.monotonic()
    with pytest.raises(RankDied, match=r"rank 1 of 2 died \(exit code 3\)"):
        run_distributed(_die_on_rank_1, 2, timeout=60)
    assert time.monotonic() - start < 30
    assert run_distributed(_all_reduce_rank, 2)[1] == (1, 2, 3.0)


def test_hung_rank_times_out_with_stacks():
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"did not finish .*within 5 s") as info:
        run_distributed(_hang_on_rank_1, 2, timeout=5)
    elapsed = time.monotonic() - start
    assert elapsed < 20, elapsed
    # The hung rank's stack points at the sleep in the test function.
    assert "_hang_on_rank_1" in str(info.value)
    assert run_distributed(_all_reduce_rank, 2)[0] == (0, 2, 3.0)
