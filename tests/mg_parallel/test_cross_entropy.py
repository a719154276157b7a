"""Vocab-parallel cross entropy, whole and chunked (fused with the output projection), against
F.cross_entropy on the full, unpadded logits."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mg_parallel.grid import ParallelDims, build_grid
from mg_parallel.tensor_parallel import (
    chunked_vocab_parallel_cross_entropy,
    copy_to_tp_region,
    pad_vocab_size,
    vocab_parallel_cross_entropy,
)

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
        _chunked_cases(g, tp, r, gen, smoothing)
    return "ok"


def _chunked_case(tp_group, tp: int, rank: int, gen: torch.Generator, *, vocab: int, padded: int,
                  smoothing: float, chunk: int) -> float:
    """Chunked loss and grads of hidden [5, 3, h] and the weight shard against F.linear + F.cross_entropy on the
    full weight; returns the largest difference."""
    s, b, h = 5, 3, 6
    case = f"chunked tp={tp} vocab={vocab} padded={padded} smoothing={smoothing} chunk={chunk}"
    hidden = torch.randn(s, b, h, generator=gen)
    weight = torch.randn(padded, h, generator=gen)
    target = torch.randint(0, vocab, (s, b), generator=gen)
    target[0, 0], target[1, 1] = vocab - 1, 0
    target[2, :2] = -100
    weights = torch.rand(s, b, generator=gen)

    ref_hidden, ref_weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref = F.cross_entropy(F.linear(ref_hidden, ref_weight)[..., :vocab].reshape(-1, vocab), target.reshape(-1),
                          reduction="none", label_smoothing=smoothing).view(s, b)
    (ref * weights).sum().backward()

    x = hidden.clone().requires_grad_(True)
    shard = weight.chunk(tp, dim=0)[rank].clone().requires_grad_(True)
    # The caller enters the tp region: copy_to_tp_region's backward sums the ranks' partial hidden grads.
    loss = chunked_vocab_parallel_cross_entropy(copy_to_tp_region(x, tp_group), shard, target, tp_group=tp_group,
                                                vocab_size=vocab, label_smoothing=smoothing, chunk_tokens=chunk)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    (loss * weights).sum().backward()
    assert torch.all(loss[2, :2] == 0), f"{case}: ignored positions must have loss 0"
    expect_w = ref_weight.grad.chunk(tp, dim=0)[rank]
    for what, got, want in (("loss", loss, ref), ("hidden grad", x.grad, ref_hidden.grad),
                            ("weight grad", shard.grad, expect_w)):
        assert_close(got, want.detach(), **LOSS_TOL, msg=lambda m, what=what: f"{case} {what}: {m}")
    start = rank * (padded // tp)
    assert torch.all(shard.grad[max(0, vocab - start):] == 0), f"{case}: padding rows got a gradient"
    return max((loss - ref).abs().max().item(), (x.grad - ref_hidden.grad).abs().max().item(),
               (shard.grad - expect_w).abs().max().item())


def _chunked_cases(tp_group, tp: int, rank: int, gen: torch.Generator, smoothing: float) -> float:
    worst = 0.0
    for chunk in (4, 5, 15, 64):  # 15 tokens: a chunk that does not divide them, ones that do, one chunk, larger
        worst = max(worst, _chunked_case(tp_group, tp, rank, gen, vocab=8 * tp, padded=8 * tp,
                                         smoothing=smoothing, chunk=chunk))
    worst = max(worst, _chunked_case(tp_group, tp, rank, gen, vocab=8 * tp - 3, padded=8 * tp,
                                     smoothing=smoothing, chunk=4))
    # Padding covering whole ranks' slices: only rank 0 projects onto real ids at tp > 1.
    return max(worst, _chunked_case(tp_group, tp, rank, gen, vocab=5, padded=pad_vocab_size(5, tp, multiple=6),
                                    smoothing=smoothing, chunk=4))


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


class _LargestAllocation(TorchDispatchMode):
    """Records the largest storage any aten op returns (views report their base's storage, never more)."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


def _saved_numels(fn) -> list[int]:
    """Numel of every tensor autograd saves for backward while ``fn()`` runs."""
    numels: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        numels.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return numels


def test_chunked_holds_one_chunk_of_logits():
    """Forward and backward never allocate more than one chunk's fp32 logits, and nothing of [N, V] is saved;
    the same counters see the whole [N, V] logits in the unchunked path."""
    n, h, vocab, chunk = 96, 4, 64, 8
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, h, generator=gen).requires_grad_(True)
    weight = torch.randn(vocab, h, generator=gen).requires_grad_(True)
    target = torch.randint(0, vocab, (n,), generator=gen)
    runs = {
        "chunked": lambda: chunked_vocab_parallel_cross_entropy(hidden, weight, target, chunk_tokens=chunk),
        "whole": lambda: vocab_parallel_cross_entropy(F.linear(hidden, weight).float(), target),
    }
    peak, saved = {}, {}
    for name, loss_fn in runs.items():
        mode = _LargestAllocation()
        with mode:
            loss_fn().sum().backward()
        peak[name] = mode.nbytes
        saved[name] = max(_saved_numels(loss_fn))
    logits_bytes = n * vocab * 4
    assert peak["whole"] >= logits_bytes and saved["whole"] >= n * vocab  # the counters see the whole logits
    assert peak["chunked"] <= chunk * vocab * 4 < logits_bytes // 10, peak
    assert saved["chunked"] == max(n * h, vocab * h), saved  # hidden and weight only, no logits


def test_chunked_matches_unchunked_in_bf16():
    """bf16 inputs: the loss equals the unchunked path's on the same bf16 logits, the grads keep bf16."""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 11, 8, generator=gen).to(torch.bfloat16)
    weight = torch.randn(24, 8, generator=gen).to(torch.bfloat16)
    target = torch.randint(0, 20, (2, 11), generator=gen)
    target[0, 3] = -100
    grads = {}
    for name in ("chunked", "whole"):
        x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if name == "chunked":
            loss = chunked_vocab_parallel_cross_entropy(x, w, target, vocab_size=20, chunk_tokens=4)
        else:
            loss = vocab_parallel_cross_entropy(F.linear(x, w).float(), target, vocab_size=20)
        loss.sum().backward()
        grads[name] = (loss, x.grad, w.grad)
    (loss, gx, gw), (ref, ref_gx, ref_gw) = grads["chunked"], grads["whole"]
    assert loss.dtype == torch.float32 and gx.dtype == gw.dtype == torch.bfloat16
    assert_close(loss, ref, **LOSS_TOL)
    assert_close(gx, ref_gx, **BF16_GRAD_TOL)
    # The chunks' bf16 products are summed in fp32, one bf16 matmul sums all tokens at once: they differ by
    # roundings of the partial sums, which can cancel, so the bound is one bf16 ulp of the gradient's scale.
    assert_close(gw, ref_gw, rtol=0, atol=2.0**-7 * ref_gw.abs().max().item())


def test_chunked_bad_arguments_raise():
    hidden, weight, target = torch.randn(3, 4), torch.randn(8, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_vocab_parallel_cross_entropy(hidden, weight, target, chunk_tokens=0)
    with pytest.raises(ValueError, match="label_smoothing"):
        chunked_vocab_parallel_cross_entropy(hidden, weight, target, label_smoothing=1.0)
    with pytest.raises(ValueError, match="vocab_size=9"):
        chunked_vocab_parallel_cross_entropy(hidden, weight, target, vocab_size=9)
    with pytest.raises(ValueError, match="target shape"):
        chunked_vocab_parallel_cross_entropy(hidden, weight, target[:2])
    with pytest.raises(ValueError, match="weight"):
        chunked_vocab_parallel_cross_entropy(hidden, weight[:, :3], target)
    with pytest.raises(ValueError, match="weight"):
        chunked_vocab_parallel_cross_entropy(hidden, weight.double(), target)
