"""RNGTracker: dropout streams shared or distinct across ranks as the layout requires."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mg_parallel.grid import ParallelDims, ProcessGrid, build_grid
from mg_parallel.tensor_parallel import TENSOR_PARALLEL_STREAM, RNGTracker

_DEVICE = [torch.device("cpu")]


def _mask(n: int = 256) -> torch.Tensor:
    # Draw on the tracker's device: that is the generator fork() swaps.
    return (F.dropout(torch.ones(n, device=_DEVICE[0]), 0.5, True) != 0).cpu()


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    t = t.to(_DEVICE[0])
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    out = [o.cpu() for o in out]
    return out


def _check_streams(tp: int, pp: int) -> str:
    grid = build_grid(ParallelDims(tp=tp, pp=pp))
    dims = grid.dims
    _DEVICE[0] = grid.device
    tracker = RNGTracker(1234, grid)
    default_mask = _mask()
    with tracker.fork():
        forked_mask = _mask()
    after_fork = _mask()

    defaults = _gather(default_mask.to(torch.uint8))
    forkeds = _gather(forked_mask.to(torch.uint8))
    for other in range(grid.world_size):
        c = dims.coords(other)
        same_stage = c["pp"] == grid.pp_rank
        same_tp = c["tp"] == grid.tp_rank
        # Default stream: identical across tp (and dp) ranks of a stage, different across stages.
        assert torch.equal(defaults[other], defaults[grid.rank]) == same_stage, (other, "default")
        # Forked stream: different per tp rank; identical for the same tp rank of other dp replicas.
        assert torch.equal(forkeds[other], forkeds[grid.rank]) == (same_stage and same_tp), (other, "fork")

    # fork() leaves the default stream where it was.
    fresh = RNGTracker(1234, grid)
    assert torch.equal(_mask(), default_mask)
    assert torch.equal(_mask(), after_fork)
    del fresh

    # get_state / set_state replay a stream exactly, and the default stream's too.
    streams, default = tracker.get_state(), tracker.get_default_state()
    with tracker.fork():
        first = _mask()
    second_default = _mask()
    tracker.set_state(streams)
    tracker.set_default_state(default)
    with tracker.fork():
        assert torch.equal(_mask(), first)
    assert torch.equal(_mask(), second_default)
    with tracker.fork():
        assert not torch.equal(_mask(), first)  # the stream advanced
    return "ok"


@pytest.mark.parametrize("world, tp, pp", [(2, 2, 1), (4, 2, 1), (4, 2, 2)])
def test_rng_streams_across_ranks(world, tp, pp):
    from mg_parallel.testing import run_distributed

    assert run_distributed(_check_streams, world, tp, pp) == ["ok"] * world


def test_single_process_tracker():
    _DEVICE[0] = torch.device("cpu")
    tracker = RNGTracker(7, ProcessGrid.single(torch.device("cpu")))
    assert tracker.names == [TENSOR_PARALLEL_STREAM]
    torch.manual_seed(7)
    expected_default = _mask()
    tracker2 = RNGTracker(7, ProcessGrid.single(torch.device("cpu")))
    with tracker2.fork():
        forked = _mask()
    assert torch.equal(_mask(), expected_default)
    assert not torch.equal(forked, expected_default)
    tracker.add("experts", 99)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("experts", 1)
    with pytest.raises(KeyError, match="unknown"):
        with tracker.fork("unknown"):
            pass
    with pytest.raises(ValueError, match="seed"):
        RNGTracker(-1, ProcessGrid.single(torch.device("cpu")))
