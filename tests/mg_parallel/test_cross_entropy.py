"""Vocab-parallel cross entropy against F.cross_entropy on the full, unpadded logits."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from mg_parallel.grid import ParallelDims, build_grid
from mg_parallel.tensor_parallel import pad_vocab_size, vocab_parallel_cross_entropy

TOL = {"rtol": 1e-5, "atol": 1e-5}
# The loss is computed in fp32 from the (upcast) logits whatever their dtype, so it meets F.cross_entropy on the
# same logits upcast to fp32 to within fp32 rounding. Only that is left: the shards' partial sums are added in
# another order, which moves a loss of ~10 by an ulp or two (1e-6 to 2e-6).
LOSS_TOL = {"rtol": 1e-6, "atol": 1e-6}
# A bf16 gradient is the fp32 one rounded once: at most one bf16 ulp (2**-7 relative) from the rounded reference.
BF16_GRAD_TOL = {"rtol": 2.0**-7, "atol": 1e-7}


def _case(tp_group, tp: int, rank: int, gen: torch.Generator, *, vocab: int, padded: int, smoothing: float,
          pass_vocab: bool, dtype: torch.dtype = torch.float32) -> None:
    s, b = 5, 3
    case = f"tp={tp} vocab={vocab} padded={padded} smoothing={smoothing} dtype={dtype}"
    logits = torch.randn(s, b, padded, generator=gen) * 3
    # Garbage in the padding columns: large enough to dominate any softmax that included them.
    logits[..., vocab:] = 1e4 * torch.rand(s, b, padded - vocab, generator=gen)
    target = torch.randint(0, vocab, (s, b), generator=gen)
    target[0, 0], target[1, 1] = vocab - 1, 0
    target[2, :2] = -100  # ignored
    weights = torch.rand(s, b, generator=gen)  # a non-uniform upstream gradient

    ref_logits = logits.to(dtype).float().requires_grad_(True)
    ref = F.cross_entropy(
        ref_logits[..., :vocab].reshape(-1, vocab), target.reshape(-1), reduction="none", label_smoothing=smoothing
    ).view(s, b)
    (ref * weights).sum().backward()

    shard = logits.chunk(tp, dim=-1)[rank].to(dtype).detach().clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(
        shard, target, tp_group=tp_group, label_smoothing=smoothing, vocab_size=vocab if pass_vocab else None
    )
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    assert_close(loss, ref.detach(), **LOSS_TOL, msg=lambda m: f"{case} loss: {m}")
    assert torch.all(loss[2, :2] == 0), f"{case}: ignored positions must have loss 0"
    (loss * weights).sum().backward()
    expect = ref_logits.grad.chunk(tp, dim=-1)[rank]
    assert shard.grad.dtype == dtype
    if dtype == torch.float32:
        assert_close(shard.grad, expect, **TOL, msg=lambda m: f"{case} grad: {m}")
    else:
        assert_close(shard.grad, expect.to(dtype), **BF16_GRAD_TOL, msg=lambda m: f"{case} grad: {m}")
    if padded > vocab:
        full_grad = shard.grad.new_zeros(s, b, padded)
        full_grad[..., rank * (padded // tp) : (rank + 1) * (padded // tp)] = shard.grad
        assert torch.all(full_grad[..., vocab:] == 0), f"{case}: padding columns got a gradient"


def _all_checks(tp: int) -> str:
    grid = build_grid(ParallelDims(tp=tp))
    gen = torch.Generator().manual_seed(3 + 100 * grid.dp_rank)
    g, r = grid.tp_group, grid.tp_rank
    for smoothing in (0.0, 0.1):
        # No padding.
        _case(g, tp, r, gen, vocab=8 * tp, padded=8 * tp, smoothing=smoothing, pass_vocab=False)
        # Padding inside the last rank's slice.
        _case(g, tp, r, gen, vocab=8 * tp - 3, padded=8 * tp, smoothing=smoothing, pass_vocab=True)
        # Padding covering whole ranks' slices (only rank 0 holds real ids at tp > 1).
        _case(g, tp, r, gen, vocab=5, padded=pad_vocab_size(5, tp, multiple=6), smoothing=smoothing, pass_vocab=True)
        _case(g, tp, r, gen, vocab=8 * tp - 1, padded=8 * tp, smoothing=smoothing, pass_vocab=True,
              dtype=torch.bfloat16)
    return "ok"


@pytest.mark.parametrize("world, tp", [(1, 1), (2, 2), (4, 4), (4, 2)])
def test_vocab_parallel_cross_entropy_matches_full(world, tp):
    from mg_parallel.testing import run_distributed

    assert run_distributed(_all_checks, world, tp) == ["ok"] * world


def test_single_process_without_group():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 2, 10, generator=gen)
    target = torch.randint(0, 7, (4, 2), generator=gen)
    loss = vocab_parallel_cross_entropy(logits, target, vocab_size=7, label_smoothing=0.2)
    ref = F.cross_entropy(logits[..., :7].permute(0, 2, 1), target, reduction="none", label_smoothing=0.2)
    assert_close(loss, ref)


def test_pad_vocab_size():
    assert pad_vocab_size(50257, 1) == 50304
    assert pad_vocab_size(50257, 8) == 51200
    assert pad_vocab_size(1024, 4, multiple=256) == 1024
    assert pad_vocab_size(1, 2, multiple=1) == 2
    with pytest.raises(ValueError, match="tp_size"):
        pad_vocab_size(100, 0)


def test_bad_arguments_raise():
    logits, target = torch.randn(3, 8), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(logits, target, label_smoothing=1.0)
    with pytest.raises(ValueError, match="vocab_size=9"):
        vocab_parallel_cross_entropy(logits, target, vocab_size=9)
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_cross_entropy(logits, target[:2])
