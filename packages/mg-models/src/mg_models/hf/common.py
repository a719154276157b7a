"""Helpers shared by the Hugging Face adapters: vocabulary padding and rotary layouts."""

from __future__ import annotations

import torch

from mg_models.config import GPTConfig

__all__ = ["concat", "interleaved_to_half", "half_to_interleaved", "pad_vocab", "unpad_vocab"]


def concat(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat`` by copying into one new tensor.

    Same result; written with copies because the conversions also run on ``meta`` tensors to plan
    shapes, where ``torch.cat``/``torch.stack`` load torch's Python meta kernels (seconds of imports
    and tens of MB) while copies stay in C++.
    """
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    out = tensors[0].new_empty(shape)
    pos = 0
    for t in tensors:
        out.narrow(dim, pos, t.shape[dim]).copy_(t)
        pos += t.shape[dim]
    return out


def pad_vocab(w: torch.Tensor, c: GPTConfig) -> torch.Tensor:
    """Append zero rows to a [vocab, h] tensor up to ``c.padded_vocab_size`` (padded ids are never used)."""
    if w.shape[0] != c.vocab_size:
        raise ValueError(f"embedding has {w.shape[0]} rows but config vocab_size={c.vocab_size}; "
                         f"the checkpoint does not match its config.json")
    extra = c.padded_vocab_size - c.vocab_size
    return concat([w, w.new_zeros(extra, w.shape[1])]) if extra else w


def unpad_vocab(w: torch.Tensor, c: GPTConfig) -> torch.Tensor:
    """The first ``c.vocab_size`` rows of a padded [V_pad, h] tensor (contiguous copy)."""
    return w[: c.vocab_size].contiguous()


def interleaved_to_half(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Permute q/k projection rows from the interleaved rotary layout (pairs ``(2i, 2i+1)``, Meta's original
    Llama checkpoints) to the half-split layout (``i, i + d/2``) used by Hugging Face and mg.

    w: [heads * head_dim, in] -> same shape.
    """
    return w.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(heads * head_dim, -1)


def half_to_interleaved(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`interleaved_to_half`."""
    return w.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(heads * head_dim, -1)
