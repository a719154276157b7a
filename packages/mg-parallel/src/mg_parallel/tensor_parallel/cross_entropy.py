"""Cross entropy over logits split along the vocabulary, without gathering them.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary. The loss
needs three per-token quantities over the whole vocabulary, each a reduction of the local
slices: the maximum logit (for a stable softmax; all-reduce MAX), and the target's logit and
the sum of ``exp(logit - max)`` (all-reduce SUM, packed into one collective together with the
sum of shifted logits used by label smoothing). No rank ever holds more than its own slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mg_parallel.tensor_parallel.utils import group_rank, group_size

__all__ = ["vocab_parallel_cross_entropy"]


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
        start = group_rank(group) * local_vocab
        # Padded ids sit at the end of the vocabulary: keep only this rank's real columns.
        n_valid = max(0, min(local_vocab, vocab_size - start))
        x = logits.reshape(-1, local_vocab)[:, :n_valid].float()
        t = target.reshape(-1)
        n_tokens = t.shape[0]

        if n_valid > 0:
            local_max = x.max(dim=-1).values
        else:
            local_max = torch.full((n_tokens,), float("-inf"), dtype=torch.float32, device=x.device)
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = x - local_max.unsqueeze(-1)

        in_range = (t >= start) & (t < start + n_valid)
        local_t = (t - start).masked_fill(~in_range, 0)
        stats = torch.zeros(3 if label_smoothing > 0 else 2, n_tokens, dtype=torch.float32, device=x.device)
        if n_valid > 0:
            stats[0] = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill_(~in_range, 0.0)
            if label_smoothing > 0:
                stats[2] = shifted.sum(-1)
            probs = shifted.exp_()  # shifted is no longer needed as such: reuse its memory
            stats[1] = probs.sum(-1)
        else:
            probs = shifted
        dist.all_reduce(stats, group=group)
        target_logit, sum_exp = stats[0], stats[1]

        log_z = sum_exp.log()
        loss = log_z - target_logit
        if label_smoothing > 0:
            # F.cross_entropy's definition: (1 - eps) * nll + eps * mean_k(-log p_k) over real classes.
            smooth = log_z - stats[2] / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        ignored = t == ignore_index
        loss = loss.masked_fill_(ignored, 0.0)

        probs.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(probs, in_range, local_t, ignored)
        ctx.shape = logits.shape
        ctx.dtype = logits.dtype
        ctx.label_smoothing = label_smoothing
        ctx.vocab_size = vocab_size
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        probs, in_range, local_t, ignored = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = probs  # the saved softmax is not needed after this backward: update it in place
        if eps > 0:
            grad.sub_(eps / ctx.vocab_size)
        if grad.shape[-1] > 0:
            rows = torch.arange(grad.shape[0], device=grad.device)
            grad[rows, local_t] -= (1.0 - eps) * in_range.to(grad.dtype)
        scale = grad_loss.reshape(-1).float().masked_fill(ignored, 0.0)
        grad.mul_(scale.unsqueeze(-1))
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
