"""Cross entropy over logits split along the vocabulary, without gathering them.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary. The loss
needs three per-token quantities over the whole vocabulary, each a reduction of the local
slices: the maximum logit (for a stable softmax; all-reduce MAX), and the target's logit and
the sum of ``exp(logit - max)`` (all-reduce SUM, packed into one collective together with the
sum of shifted logits used by label smoothing). No rank ever holds more than its own slice.

:func:`chunked_vocab_parallel_cross_entropy` fuses the output projection into the loss: it
takes the hidden states and the weight shard, and holds the logits of one chunk of tokens at a
time (recomputed in backward), for vocabularies whose ``[tokens, V/tp]`` fp32 logits are the
largest tensor of a step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mg_parallel.gemm import PLAIN_GEMM, Gemm
from mg_parallel.tensor_parallel.utils import group_rank, group_size

__all__ = ["chunked_vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy"]

DEFAULT_CHUNK_TOKENS = 1024
"""Tokens per chunk of :func:`chunked_vocab_parallel_cross_entropy`: ~``1024 * V/tp * 4`` bytes of fp32 logits."""


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    if group_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def _real_columns(local_vocab: int, group: dist.ProcessGroup | None, vocab_size: int) -> tuple[int, int]:
    """(first vocabulary id of this rank's shard, how many of its columns are real, not padding)."""
    start = group_rank(group) * local_vocab
    # Padded ids sit at the end of the vocabulary: keep only this rank's real columns.
    return start, max(0, min(local_vocab, vocab_size - start))


def _targets(t: torch.Tensor, start: int, n_valid: int,
             ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target on this rank, its local column (0 elsewhere), target ignored) for targets ``t`` [n]."""
    in_range = (t >= start) & (t < start + n_valid)
    return in_range, (t - start).masked_fill(~in_range, 0), t == ignore_index


def _softmax_loss(
    x: torch.Tensor,
    in_range: torch.Tensor,
    local_t: torch.Tensor,
    ignored: torch.Tensor,
    group: dist.ProcessGroup | None,
    label_smoothing: float,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss of fp32 logits ``x`` [n, n_valid] (this rank's real columns) over the whole vocabulary.

    Returns (loss [n], 0 where ignored; ``exp(x - max)`` [n, n_valid]; max [n]; sum of exp [n]), all fp32.
    """
    n_tokens = x.shape[0]
    if x.shape[-1] > 0:
        local_max = x.max(dim=-1).values
    else:
        local_max = torch.full((n_tokens,), float("-inf"), dtype=torch.float32, device=x.device)
    _all_reduce(local_max, group, dist.ReduceOp.MAX)
    shifted = x - local_max.unsqueeze(-1)

    stats = torch.zeros(3 if label_smoothing > 0 else 2, n_tokens, dtype=torch.float32, device=x.device)
    if x.shape[-1] > 0:
        stats[0] = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill_(~in_range, 0.0)
        if label_smoothing > 0:
            stats[2] = shifted.sum(-1)
        stats[1] = shifted.exp_().sum(-1)  # shifted is no longer needed as such: reuse its memory
    _all_reduce(stats, group)
    target_logit, sum_exp = stats[0], stats[1]

    log_z = sum_exp.log()
    loss = log_z - target_logit
    if label_smoothing > 0:
        # F.cross_entropy's definition: (1 - eps) * nll + eps * mean_k(-log p_k) over real classes.
        smooth = log_z - stats[2] / vocab_size
        loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
    return loss.masked_fill_(ignored, 0.0), shifted, local_max, sum_exp


def _logits_grad_(
    probs: torch.Tensor,
    in_range: torch.Tensor,
    local_t: torch.Tensor,
    ignored: torch.Tensor,
    grad_loss: torch.Tensor,
    label_smoothing: float,
    vocab_size: int,
) -> torch.Tensor:
    """Turn the softmax ``probs`` [n, n_valid] into the loss's gradient of the logits times ``grad_loss`` [n], in place."""
    grad = probs
    if label_smoothing > 0:
        grad.sub_(label_smoothing / vocab_size)
    if grad.shape[-1] > 0:
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= (1.0 - label_smoothing) * in_range.to(grad.dtype)
    scale = grad_loss.reshape(-1).float().masked_fill(ignored, 0.0)
    return grad.mul_(scale.unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: dist.ProcessGroup,
        label_smoothing: float,
        ignore_index: int,
        vocab_size: int,
    ) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        start, n_valid = _real_columns(local_vocab, group, vocab_size)
        x = logits.reshape(-1, local_vocab)[:, :n_valid].float()
        in_range, local_t, ignored = _targets(target.reshape(-1), start, n_valid, ignore_index)
        loss, probs, _, sum_exp = _softmax_loss(x, in_range, local_t, ignored, group, label_smoothing, vocab_size)
        probs.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(probs, in_range, local_t, ignored)
        ctx.shape = logits.shape
        ctx.dtype = logits.dtype
        ctx.label_smoothing = label_smoothing
        ctx.vocab_size = vocab_size
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        # The saved softmax is not needed after this backward: update it in place.
        grad = _logits_grad_(*ctx.saved_tensors, grad_loss, ctx.label_smoothing, ctx.vocab_size)
        local_vocab = ctx.shape[-1]
        if grad.shape[-1] < local_vocab:
            grad = F.pad(grad, (0, local_vocab - grad.shape[-1]))
        return grad.to(ctx.dtype).view(ctx.shape), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token cross entropy of logits split along the vocabulary over ``tp_group``.

    Matches ``F.cross_entropy(full_logits[..., :vocab_size], target, reduction="none",
    ignore_index=..., label_smoothing=...)`` computed on the gathered logits, but each rank
    only touches its own ``[..., V_padded/tp]`` slice (rank ``r`` holds vocabulary ids
    ``[r*V_padded/tp, (r+1)*V_padded/tp)``, the layout of :class:`ColumnParallelLinear` and
    :class:`VocabParallelEmbedding`).

    Args:
        logits: this rank's vocabulary slice, ``[..., V_padded/tp]``, any float dtype (the
            computation is done in fp32; the gradient has the logits' dtype).
        target: int64 class ids ``[...]`` (the logits' leading shape), in ``[0, vocab_size)`` or
            equal to ``ignore_index``.
        tp_group: tensor-parallel group; None means the logits are the whole vocabulary.
        label_smoothing: in ``[0, 1)``; spread over the ``vocab_size`` real classes only.
        ignore_index: targets with this value get loss 0 and no gradient.
        vocab_size: the real (unpadded) vocabulary; columns at ids ``>= vocab_size`` are
            padding, excluded from the softmax whatever values they hold. None: no padding.

    Returns:
        float32 loss per token, shape of ``target``, 0 at ignored positions.

    Raises:
        ValueError: ``label_smoothing`` outside ``[0, 1)``, ``vocab_size`` larger than the
            padded vocabulary, or ``target``'s shape not the logits' leading shape.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal the logits' leading shape {tuple(logits.shape[:-1])}"
        )
    world = group_size(tp_group)
    padded = logits.shape[-1] * world
    if vocab_size is not None and not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, padded vocabulary {padded}]")
    if world == 1:
        if vocab_size is not None and vocab_size < padded:
            logits = logits[..., :vocab_size]
        # fp32 from the upcast logits, as the sharded path: F.cross_entropy on bf16/fp16 logits would round
        # its log-softmax to that dtype (an error of ~1e-2 on the loss).
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            target.reshape(-1),
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            reduction="none",
        )
        return loss.view(target.shape)
    return _VocabParallelCrossEntropy.apply(
        logits, target, tp_group, float(label_smoothing), ignore_index, padded if vocab_size is None else vocab_size
    )


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    """Output projection + vocab-parallel cross entropy, ``chunk`` tokens of logits at a time.

    Forward keeps only the loss and the log-sum-exp per token; backward recomputes each chunk's
    logits to form its softmax, and from it the chunk's rows of the hidden's gradient and its
    share of the weight's gradient.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        group: dist.ProcessGroup | None,
        label_smoothing: float,
        ignore_index: int,
        vocab_size: int,
        chunk: int,
        gemm: Gemm,
    ) -> torch.Tensor:
        start, n_valid = _real_columns(weight.shape[0], group, vocab_size)
        real = weight[:n_valid]  # padding rows never enter the softmax: no need to project onto them
        n_tokens = hidden.shape[0]
        loss = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        log_sum_exp = torch.empty_like(loss)
        for lo in range(0, n_tokens, chunk):
            rows = slice(lo, lo + chunk)
            x = gemm.linear(hidden[rows], real).float()  # [chunk, n_valid], as the unchunked F.linear then .float()
            in_range, local_t, ignored = _targets(target[rows], start, n_valid, ignore_index)
            loss[rows], _, max_logit, sum_exp = _softmax_loss(x, in_range, local_t, ignored, group,
                                                              label_smoothing, vocab_size)
            log_sum_exp[rows] = max_logit + sum_exp.log()
        ctx.save_for_backward(hidden, weight, target, log_sum_exp)
        ctx.args = (start, n_valid, group, label_smoothing, ignore_index, vocab_size, chunk, gemm)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, target, log_sum_exp = ctx.saved_tensors
        start, n_valid, group, label_smoothing, ignore_index, vocab_size, chunk, gemm = ctx.args
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        real = weight[:n_valid]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Summed over chunks in fp32 and rounded once, as the unchunked matmul rounds its sum once; padding rows
        # keep a zero gradient.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        for lo in range(0, hidden.shape[0], chunk):
            rows = slice(lo, lo + chunk)
            h = hidden[rows]
            probs = gemm.linear(h, real).float().sub_(log_sum_exp[rows].unsqueeze(-1)).exp_()  # softmax [chunk, n_valid]
            in_range, local_t, ignored = _targets(target[rows], start, n_valid, ignore_index)
            grad = _logits_grad_(probs, in_range, local_t, ignored, grad_loss[rows], label_smoothing, vocab_size)
            grad = grad.to(hidden.dtype)  # the unchunked path's .float() hands F.linear a gradient of this dtype
            if grad_hidden is not None:
                grad_hidden[rows] = gemm.mm(grad, real)
            if grad_weight is not None:
                grad_weight[:n_valid] += gemm.mm(grad.t(), h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def chunked_vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    gemm: Gemm = PLAIN_GEMM,
) -> torch.Tensor:
    """Per-token cross entropy of the logits ``hidden @ weight.T``, computed ``chunk_tokens`` tokens at a time.

    Equals ``vocab_parallel_cross_entropy(F.linear(hidden, weight).float(), target, ...)`` in loss and
    gradients, but never holds more than ``[chunk_tokens, V_padded/tp]`` logits: forward saves only
    ``hidden``, ``weight``, ``target`` and one fp32 log-sum-exp per token, and backward recomputes each
    chunk's logits (one more ``[tokens, h] x [h, V/tp]`` matmul than the unchunked path). Each chunk's
    logits are computed in ``hidden``'s dtype and upcast to fp32, as the unchunked path does.

    At tp > 1 ``hidden`` must be the same on every rank of ``tp_group``, and the caller passes it through
    :func:`copy_to_tp_region` (or :func:`gather_from_sequence_parallel_region`) first, as before any
    column-parallel projection: the gradient this function returns for ``hidden`` is this rank's
    partial sum over its vocabulary shard, and that mapping's backward sums it over the group.

    Args:
        hidden: ``[..., h]`` hidden states (any float dtype, the weight's).
        weight: this rank's vocabulary shard ``[V_padded/tp, h]`` (rank ``r`` holds ids
            ``[r*V_padded/tp, (r+1)*V_padded/tp)``, the layout of :class:`ColumnParallelLinear` and
            :class:`VocabParallelEmbedding`).
        target: int64 class ids ``[...]`` (``hidden``'s leading shape), in ``[0, vocab_size)`` or equal to
            ``ignore_index``.
        tp_group: tensor-parallel group; None means ``weight`` is the whole vocabulary.
        vocab_size: the real (unpadded) vocabulary; ids ``>= vocab_size`` are padding, excluded from the
            softmax. None: no padding.
        ignore_index: targets with this value get loss 0 and no gradient.
        label_smoothing: in ``[0, 1)``; spread over the ``vocab_size`` real classes only.
        chunk_tokens: tokens per chunk (the last chunk may be shorter); larger chunks make fewer, larger
            matmuls and hold ``chunk_tokens * V_padded/tp`` fp32 logits.
        gemm: the GEMM recipe of the projections (``linear`` for each chunk's logits, forward and
            recomputed, ``mm`` for the gradients; see :mod:`mg_parallel.gemm`).

    Returns:
        float32 loss per token, shape of ``target``, 0 at ignored positions. The gradients of ``hidden``
        and ``weight`` have their dtypes; the weight's is summed over chunks in fp32.

    Raises:
        ValueError: ``weight`` not ``[V, h]`` with ``hidden``'s h and dtype, ``target``'s shape not
            ``hidden``'s leading shape, ``chunk_tokens`` below 1, ``label_smoothing`` outside ``[0, 1)``, or
            ``vocab_size`` outside ``[1, padded vocabulary]``.
    """
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.dtype != hidden.dtype:
        raise ValueError(f"weight {weight.dtype} {tuple(weight.shape)} must be [V_padded/tp, h] of hidden's dtype "
                         f"and h (hidden {hidden.dtype} {tuple(hidden.shape)})")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal the hidden's leading shape {tuple(hidden.shape[:-1])}"
        )
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    padded = weight.shape[0] * group_size(tp_group)
    if vocab_size is not None and not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, padded vocabulary {padded}]")
    loss = _ChunkedVocabParallelCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), tp_group, float(label_smoothing),
        ignore_index, padded if vocab_size is None else vocab_size, chunk_tokens, gemm,
    )
    return loss.view(target.shape)
