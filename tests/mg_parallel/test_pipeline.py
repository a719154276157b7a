"""Pipeline pieces that need no second process: partitioning, the timetable, argument checks,
and the no-pipelining schedule against plain gradient accumulation."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch import nn

from mg_parallel import ParallelDims, ProcessGrid
from mg_parallel.pipeline import (
    forward_backward_1f1b,
    forward_backward_interleaved,
    forward_backward_no_pipelining,
    get_forward_backward_func,
    partition_layers,
    pipeline_plan,
)
from tests.mg_parallel import test_pipeline_model as M


def _fake_grid(pp: int, pp_rank: int = 0) -> ProcessGrid:
    # Enough of a grid for argument checks that happen before any communication.
    dims = ParallelDims(pp=pp, world_size=pp)
    return ProcessGrid(dims=dims, rank=pp_rank, world_size=pp, tp_rank=0, cp_rank=0, dp_rank=0, pp_rank=pp_rank,
                       pp_ranks=list(range(pp)), tp_ranks=[pp_rank], dp_ranks=[pp_rank])


def test_partition_even_uneven_and_interleaved():
    assert partition_layers(8, 4) == [[range(0, 2)], [range(2, 4)], [range(4, 6)], [range(6, 8)]]
    assert partition_layers(8, 2, first=3) == [[range(0, 3)], [range(3, 8)]]
    assert partition_layers(10, 4, first=1, last=3) == [[range(0, 1)], [range(1, 4)], [range(4, 7)], [range(7, 10)]]
    # Virtual stage s = chunk * pp + rank: rank 0 holds blocks 0 and 2 of 4.
    assert partition_layers(8, 2, vpp=2) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    ranges = partition_layers(8, 2, vpp=2, first=0, last=2)
    flat = sorted((r for rank in ranges for r in rank), key=lambda r: r.start)
    assert [len(r) for r in flat] == [0, 3, 3, 2] and list(range(8)) == [i for r in flat for i in r]
    assert partition_layers(5, 1) == [[range(0, 5)]]


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((7, 2), {}, r"7 layers cannot be split evenly over 2 .*set first=/last="),
        ((8, 4), {"first": 3, "last": 2}, r"3 layers cannot be split evenly over 2"),
        ((8, 2), {"first": 5, "last": 4}, r"do not fit num_layers=8"),
        ((8, 0), {}, r"pp must be a positive integer"),
        ((8, 2), {"first": -1}, r"first must be None or a non-negative integer"),
        ((8, 1), {"first": 3}, r"single stage"),
    ],
)
def test_partition_errors_name_the_option(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        partition_layers(*args, **kwargs)


@pytest.mark.parametrize("pp, vpp", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (4, 2), (2, 3), (4, 3)])
def test_timetable_completes_and_pairs_every_message(pp, vpp):
    for m in range(1, 10):
        if vpp > 1 and m % pp:
            continue
        for forward_only in (False, True):
            plan = pipeline_plan(pp, vpp, m, forward_only)
            for steps in plan:
                ops = Counter((s.op.kind, s.op.chunk, s.op.microbatch) for s in steps if s.op)
                kinds = ("F",) if forward_only else ("F", "B")
                assert ops == Counter((k, c, i) for k in kinds for c in range(vpp) for i in range(m))
            sends, recvs = Counter(), Counter()
            for rank, steps in enumerate(plan):
                for s in steps:
                    for peer, msg in s.sends:
                        sends[(rank, peer, msg)] += 1
                    for peer, msg in s.recvs:
                        recvs[(peer, rank, msg)] += 1
                    # One message per direction and peer per step: batches cannot mismatch.
                    assert len({p for p, _ in s.sends}) == len(s.sends)
                    assert len({p for p, _ in s.recvs}) == len(s.recvs)
            assert sends == recvs and all(v == 1 for v in sends.values())
            for a in range(pp):  # same order of messages on both ends of every link
                for b in range(pp):
                    out = [msg for s in plan[a] for p, msg in s.sends if p == b]
                    inn = [msg for s in plan[b] for p, msg in s.recvs if p == a]
                    assert out == inn


def test_factory_and_argument_checks():
    assert get_forward_backward_func(ProcessGrid.single()) is forward_backward_no_pipelining
    assert get_forward_backward_func(_fake_grid(2)) is forward_backward_1f1b
    assert get_forward_backward_func(_fake_grid(2), 2) is forward_backward_interleaved
    with pytest.raises(ValueError, match="virtual_pipeline_size=2 needs parallel.pp >= 2"):
        get_forward_backward_func(ProcessGrid.single(), 2)
    with pytest.raises(ValueError, match="virtual_pipeline_size must be None or a positive integer"):
        get_forward_backward_func(_fake_grid(2), 0)
    chunks = [nn.Linear(2, 2), nn.Linear(2, 2)]
    with pytest.raises(ValueError, match=r"multiple of parallel.pp=4, got 6; use 4 or 8"):
        forward_backward_interleaved(None, None, chunks, 6, _fake_grid(4), tensor_shape=(1,))
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer"):
        forward_backward_1f1b(None, None, chunks[:1], 0, _fake_grid(2), tensor_shape=(1,))
    with pytest.raises(ValueError, match="needs parallel.pp >= 2 and one model chunk"):
        forward_backward_1f1b(None, None, chunks, 2, _fake_grid(2), tensor_shape=(1,))
    with pytest.raises(ValueError, match="tensor_shape is required"):
        forward_backward_1f1b(None, None, chunks[:1], 2, _fake_grid(2))
    with pytest.raises(ValueError, match="needs parallel.pp=1"):
        forward_backward_no_pipelining(None, None, chunks[:1], 2, _fake_grid(2))


def test_stage_output_shape_and_missing_set_input_tensor_are_clear_errors():
    stage = M.Stage(range(2), first=True, last=False)
    batches = iter(M.make_batches(0, 2))
    step = lambda batch, model: (model(batch[0]), None)
    with pytest.raises(ValueError, match=r"returned \(8, 2, 16\) but tensor_shape=\(8, 2, 4\)"):
        forward_backward_1f1b(step, batches, stage, 2, _fake_grid(2), tensor_shape=(8, 2, 4))
    with pytest.raises(TypeError, match="has no set_input_tensor"):
        forward_backward_1f1b(step, batches, nn.Linear(2, 2), 2, _fake_grid(2), tensor_shape=(8, 2, 16))


class _NoSyncRecorder(nn.Module):
    """Stands in for a DDP wrapper: records whether each backward ran inside no_sync()."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module, self.syncing, self.log = module, True, []

    @contextlib.contextmanager
    def no_sync(self):
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def forward(self, tokens):
        out = self.module(tokens)
        if out.requires_grad:
            out.register_hook(lambda g: self.log.append(self.syncing))
        return out


def _step(batch, model):
    tokens, labels = batch
    return model(tokens), lambda logits: (M.microbatch_loss(logits, labels), {})


def test_no_pipelining_matches_gradient_accumulation():
    with M.one_thread():
        _no_pipelining(3)


def _no_pipelining(m: int) -> None:
    ref_losses, ref_eval, ref_params = M.reference_run(m)
    model = M.Stage(range(M.NUM_LAYERS), first=True, last=True)
    wrapped = _NoSyncRecorder(model)
    opt = torch.optim.SGD(model.parameters(), lr=M.LR, momentum=M.MOMENTUM)
    grid = ProcessGrid.single()
    fb = get_forward_backward_func(grid)
    losses = []
    for step in range(M.STEPS):
        opt.zero_grad()
        out = fb(_step, iter(M.make_batches(step, m)), [wrapped], m, grid, scale_loss=lambda x: x * 8.0)
        for p in model.parameters():
            p.grad /= 8.0
        losses.append(sum(o["loss"].item() for o in out) / m)
        opt.step()
    assert wrapped.log == [False, False, True] * M.STEPS  # reduce only during the last microbatch
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    out = fb(_step, iter(M.make_batches(M.STEPS, m)), wrapped, m, grid, forward_only=True)
    assert sum(o["loss"].item() for o in out) / m == pytest.approx(ref_eval, rel=1e-5)
    for name, value in model.global_params().items():
        torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-6)
