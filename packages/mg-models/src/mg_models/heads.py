"""Sequence-classification heads and their loss (the heads of Hugging Face's ``*ForSequenceClassification``).

A model built with ``head="classification"`` ends in a small head replicated on every tp rank
instead of the vocabulary projection:

* GPT family: ``score`` (``Linear(hidden, num_labels, bias=False)``) on the final hidden state of
  the last non-padding token of each sequence (:func:`last_token_hidden`);
* BERT: the tanh ``pooler`` on ``[CLS]``, dropout, then ``classifier`` (``Linear(hidden, num_labels)``).

:func:`classification_loss` picks the loss as Hugging Face does when ``problem_type`` is unset:
squared error for one label (regression), cross entropy for integer labels, binary cross entropy
for float labels (multi-label).

Every matmul of these heads goes through the head's GEMM recipe (its ``gemm`` attribute, see
:mod:`mg_parallel.gemm`), so :func:`~mg_parallel.gemm.use_gemm` reaches them as it reaches the layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mg_models.init import normal_init
from mg_models.layers import TiedGradient, tied_projection
from mg_models.spec import BuildContext
from mg_parallel.gemm import PLAIN_GEMM, Gemm
from mg_parallel.tensor_parallel import (
    chunked_vocab_parallel_cross_entropy,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    mark_replicated,
    set_tensor_parallel,
)

__all__ = ["WORD_EMBEDDING", "ParallelLMHead", "ReplicatedLinear", "classification_loss", "full_sequence",
           "last_token_hidden", "replicated_linear"]


class ReplicatedLinear(nn.Linear):
    """An ``nn.Linear`` whose matmul is its GEMM recipe's ``linear`` (``self.gemm``; default the plain
    ``F.linear``, so it computes exactly what ``nn.Linear`` does)."""

    def __init__(self, in_features: int, out_features: int, *, gemm: Gemm = PLAIN_GEMM, **kw: object) -> None:
        super().__init__(in_features, out_features, **kw)
        self.gemm = gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [*, in] -> [*, out]``."""
        return self.gemm.linear(x, self.weight, self.bias)


def replicated_linear(ctx: BuildContext, name: str, n_in: int, n_out: int, *, bias: bool = True,
                      gemm: Gemm = PLAIN_GEMM) -> ReplicatedLinear:
    """A :class:`ReplicatedLinear` ``[n_out, n_in]`` held whole on every tp rank (tagged replicated): weight
    N(0, std) seeded by ``(ctx.seed, f"{name}.weight")``, bias 0; its matmul is ``gemm``'s."""
    layer = ReplicatedLinear(n_in, n_out, bias=bias, dtype=ctx.dtype, device=ctx.device, gemm=gemm)
    normal_init(ctx.seed, f"{name}.weight", ctx.config.init_method_std)(layer.weight)
    if bias:
        with torch.no_grad():
            layer.bias.zero_()
    mark_replicated(layer)
    return layer


def full_sequence(ctx: BuildContext, x: torch.Tensor) -> torch.Tensor:
    """The whole sequence [s, b, h] of the stream x [s(/tp), b, h], for a head that runs replicated on every tp rank.

    Under sequence parallelism the chunks are gathered; backward keeps this rank's chunk of the
    gradient (no reduce-scatter), since every rank computes the same replicated head.
    """
    if ctx.sequence_parallel:
        return gather_from_sequence_parallel_region(x, ctx.tp_group, tensor_parallel_output_grad=False)
    return x


def last_token_hidden(x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Hidden state of each sequence's last non-padding token: x [s, b, h] -> [b, h].

    The token is the rightmost one whose ``attention_mask`` [b, s] is 1, which handles left and right
    padding alike (Hugging Face's rule, with the mask standing for ``input_ids != pad_token_id``);
    without a mask it is the last position.

    Raises:
        ValueError: ``attention_mask`` is not [b, s].
    """
    s, b = x.shape[0], x.shape[1]
    if attention_mask is None:
        return x[-1]
    if attention_mask.shape != (b, s):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected [batch, seq] = [{b}, {s}]")
    positions = torch.arange(s, device=attention_mask.device)
    last = (positions * (attention_mask != 0)).argmax(dim=-1)  # [b]
    return x[last.to(x.device), torch.arange(b, device=x.device)]  # [b, h]


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sample loss [b] (fp32) of classification logits [b, num_labels].

    * ``num_labels == 1``: squared error against float ``labels`` [b] (regression);
    * integer ``labels`` [b]: cross entropy; label -100 is ignored (loss 0);
    * float ``labels`` [b, num_labels]: binary cross entropy with logits, averaged over the labels (multi-label).

    ``loss.mean()`` is Hugging Face's loss for regression and multi-label; for cross entropy it is
    ``loss.sum() / (labels != -100).sum()``.

    Raises:
        ValueError: labels whose shape or dtype fits none of these cases.
    """
    b, n = logits.shape
    logits = logits.float()
    if n == 1:
        if labels.numel() != b or not labels.is_floating_point():
            raise ValueError(f"num_labels=1 (regression) needs float labels of shape [{b}], got "
                             f"{labels.dtype} {tuple(labels.shape)}")
        return (logits.reshape(b) - labels.reshape(b).float()).square()
    if not labels.is_floating_point():
        if labels.shape != (b,):
            raise ValueError(f"integer class labels must have shape [batch] = [{b}], got {tuple(labels.shape)}")
        return F.cross_entropy(logits, labels.long(), reduction="none", ignore_index=-100)
    if labels.shape != (b, n):
        raise ValueError(f"float (multi-label) labels must have shape [batch, num_labels] = [{b}, {n}], got "
                         f"{tuple(labels.shape)}; pass integer labels [batch] for single-label classification")
    return F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none").mean(dim=-1)


WORD_EMBEDDING = "embedding.word_embeddings.weight"
"""Global name of the GPT and BERT word embedding (the tied output head's weight)."""


class ParallelLMHead(nn.Module):
    """Output projection onto this rank's vocabulary shard: hidden [s(/tp), b, h] -> logits [s, b, V_pad/tp].

    ``weight`` is either borrowed (tied to the word embedding on the same stage) or owned
    (``self.weight``, shape ``[V_pad/tp, h]``, sharded along dim 0). Every projection onto the vocabulary
    (logits, the chunked loss, the tied projection) is a matmul of the head's GEMM recipe ``self.gemm``
    (default the plain ``F.linear`` / ``torch.mm``).
    """

    def __init__(self, ctx: BuildContext, init_name: str | None, *, gemm: Gemm = PLAIN_GEMM) -> None:
        super().__init__()
        self.ctx = ctx
        self.gemm = gemm
        if init_name is not None:
            c = ctx.config
            full = torch.empty(c.padded_vocab_size, c.hidden_size, dtype=torch.float32)
            normal_init(ctx.seed, init_name, c.init_method_std)(full)
            shard = full.chunk(ctx.tp_size, dim=0)[ctx.tp_rank].clone()
            self.weight = nn.Parameter(shard.to(device=ctx.device, dtype=ctx.dtype or torch.float32))
            set_tensor_parallel(self.weight, 0)

    def _enter_tp(self, x: torch.Tensor) -> torch.Tensor:
        """hidden [s(/tp), b, h] -> the whole sequence [s, b, h] on every tp rank (its grad summed over tp)."""
        if self.ctx.sequence_parallel:
            return gather_from_sequence_parallel_region(x, self.ctx.tp_group)
        return copy_to_tp_region(x, self.ctx.tp_group)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [s, b, V_pad/tp] (``[n, V_pad/tp]`` for rows ``[n, h]``) of hidden [s(/tp), b, h] against
        ``weight`` (the head's own when None)."""
        return self.project(self._enter_tp(x), weight)

    def project(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` for x [..., h] already whole on every tp rank (passed through
        :func:`~mg_parallel.tensor_parallel.copy_to_tp_region` or gathered) -> [..., V_pad/tp]."""
        return self.gemm.linear(x, self.weight if weight is None else weight, bias)

    def tied_projection(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        tied: TiedGradient) -> torch.Tensor:
        """:func:`~mg_models.layers.tied_projection` of x [..., h] with this head's recipe -> [..., V_pad]
        (tp = 1: ``weight`` is the whole vocabulary ``[V_pad, h]``)."""
        return tied_projection(x, weight, bias, tied, gemm=self.gemm)

    def chunked_loss(self, x: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token loss [s, b] (fp32) of hidden [s(/tp), b, h] against labels [s, b] (-100 = ignore), projecting
        ``config.cross_entropy_chunk_tokens`` tokens at a time (see
        :func:`~mg_parallel.tensor_parallel.chunked_vocab_parallel_cross_entropy`); equals the loss of
        ``forward``'s logits."""
        c = self.ctx.config
        return chunked_vocab_parallel_cross_entropy(
            self._enter_tp(x), self.weight if weight is None else weight, labels, tp_group=self.ctx.tp_group,
            vocab_size=c.vocab_size, chunk_tokens=c.cross_entropy_chunk_tokens, gemm=self.gemm)
