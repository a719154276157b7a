"""Sequence-classification heads and their loss (the heads of Hugging Face's ``*ForSequenceClassification``).

A model built with ``head="classification"`` ends in a small head replicated on every tp rank
instead of the vocabulary projection:

* GPT family: ``score`` (``Linear(hidden, num_labels, bias=False)``) on the final hidden state of
  the last non-padding token of each sequence (:func:`last_token_hidden`);
* BERT: the tanh ``pooler`` on ``[CLS]``, dropout, then ``classifier`` (``Linear(hidden, num_labels)``).

:func:`classification_loss` picks the loss as Hugging Face does when ``problem_type`` is unset:
squared error for one label (regression), cross entropy for integer labels, binary cross entropy
for float labels (multi-label).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mg_models.init import normal_init
from mg_models.spec import BuildContext
from mg_parallel.tensor_parallel import gather_from_sequence_parallel_region, mark_replicated

__all__ = ["classification_loss", "full_sequence", "last_token_hidden", "replicated_linear"]

def replicated_linear(ctx: BuildContext, name: str, n_in: int, n_out: int, *, bias: bool = True) -> nn.Linear:
    """An nn.Linear ``[n_out, n_in]`` held whole on every tp rank (tagged replicated): weight N(0, std) seeded by
    ``(ctx.seed, f"{name}.weight")``, bias 0."""
    layer = nn.Linear(n_in, n_out, bias=bias, dtype=ctx.dtype, device=ctx.device)
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
