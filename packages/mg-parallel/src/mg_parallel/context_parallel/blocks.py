"""Attention of one block of queries against one block of keys, returning the softmax statistics.

Context-parallel attention computes softmax attention piece by piece: each (query block, key block)
pair yields a partial output ``O_i`` and the log-sum-exp ``L_i`` of its scores (fp32, per query
row), and the pieces merge exactly as ``L = logaddexp_i L_i``, ``O = sum_i exp(L_i - L) O_i``
(:func:`merge_into`). The backward of a block needs only the *final* ``O`` and ``L``
(flash-attention's recurrence: ``P = exp(S - L)``, ``dS = P * (dP - rowsum(dO * O))``), so no
per-block state is kept between forward and backward.

Layout: ``q [b, hq, sq, d]``, ``k, v [b, hkv, sk, d]`` with ``hq`` a multiple of ``hkv``
(grouped-query attention: query head ``h`` uses key head ``h // (hq / hkv)``, as
``F.scaled_dot_product_attention(enable_gqa=True)``). A block's mask is one of

* ``"full"``: every query sees every key;
* ``"causal"``: query ``i`` sees keys ``j <= i`` (a square diagonal block);
* ``"masked"``: an explicit boolean ``mask [b or 1, sq, sk]`` (True = attend); a query row may see
  nothing in a block (its ``L_i`` is ``-inf`` and ``O_i`` zero).

Implementations (:func:`block_attention_impl` names the one chosen):

* ``"flash-cpu"``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, which
  return the log-sum-exp; used on the CPU. A ``"masked"`` block passes its mask as an additive
  ``-inf`` bias; the kernel reports ``lse = 0`` for a row that sees no key, which is set to ``-inf``.
* ``"flash-cuda"``: ``aten._scaled_dot_product_flash_attention`` and its backward on CUDA, for
  ``"full"`` and ``"causal"`` blocks in fp16/bf16 (the kernel takes no mask). It is used only after a
  probe on the device (a small block through both kernels, outputs, log-sum-exp and gradients compared
  with ``"reference"``) passed for that dtype and head size; otherwise the reference is used.
* ``"reference"``: plain torch in fp32 (scores materialised); used for everything else, and for every
  block under attention dropout (:mod:`~mg_parallel.context_parallel.dropout`: the block's mask is
  regenerated from global positions, in forward and again in backward).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["attend_blocks", "attend_blocks_backward", "block_attention_impl", "block_backward", "block_forward",
           "merge_into"]

_NEG_INF = float("-inf")


def block_attention_impl(device: torch.device | str, dtype: torch.dtype, kind: str = "causal",
                         head_dim: int = 64) -> str:
    """Name of the per-block attention used for ``kind`` blocks on ``device`` in ``dtype``.

    ``"flash-cpu"``, ``"flash-cuda"`` or ``"reference"`` (see the module docstring); print it on a start line.
    """
    device = torch.device(device)
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16):
        return "flash-cpu"
    if (device.type == "cuda" and kind in ("full", "causal") and dtype in (torch.bfloat16, torch.float16)
            and _flash_cuda_works(device, dtype, head_dim)):
        return "flash-cuda"
    return "reference"


_FLASH_CUDA_OK: dict[tuple[str, torch.dtype, int], bool] = {}
_FLASH_CUDA_EMPTY: dict[tuple[str, torch.dtype], tuple[torch.Tensor, ...]] = {}


def _flash_cuda_placeholders(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """What the CUDA flash forward returns for a dense batch without dropout (sequence offsets, RNG state), the
    same for every call: its backward takes them back. Blocks keep no per-block state, so they are taken once
    from a small forward."""
    key = (str(device), dtype)
    if key not in _FLASH_CUDA_EMPTY:
        x = torch.zeros(1, 1, 8, 8, dtype=dtype, device=device)
        outs = torch.ops.aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
        _FLASH_CUDA_EMPTY[key] = (outs[2], outs[3], outs[6], outs[7])
    return _FLASH_CUDA_EMPTY[key]


def _flash_cuda_works(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the CUDA flash kernel gives the reference's block results here (probed once per dtype and head
    size, on a 2 x 64-token block of each kind; 2% tolerance, the kernel computing in ``dtype``)."""
    key = (str(device), dtype, head_dim)
    if key not in _FLASH_CUDA_OK:
        ok = True
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            q, k, v, dout = (torch.randn(1, 2, 64, head_dim, device=device, generator=gen).to(dtype) for _ in range(4))
            for kind in ("full", "causal"):
                got = block_forward(q, k, v, kind=kind, mask=None, scale=head_dim ** -0.5, impl="flash-cuda")
                want = block_forward(q, k, v, kind=kind, mask=None, scale=head_dim ** -0.5, impl="reference")
                delta = (dout.float() * want[0]).sum(-1)
                grads = [block_backward(dout, q, k, v, want[0].to(dtype), want[1], delta, kind=kind, mask=None,
                                        scale=head_dim ** -0.5, impl=impl) for impl in ("flash-cuda", "reference")]
                pairs = [*zip(got, want), *zip(*grads)]
                ok = ok and all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in pairs)
        except (RuntimeError, NotImplementedError, TypeError):
            ok = False
        _FLASH_CUDA_OK[key] = ok
    return _FLASH_CUDA_OK[key]


def _bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # [b|1, sq, sk] bool -> additive [b|1, 1, sq, sk] bias in the kernel's dtype.
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, _NEG_INF)[:, None]


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def _reduce_kv(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, h // groups, groups, s, d).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, kind: str, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    # fp32 scores [b, hkv, g, sq, sk], -inf where masked; q heads grouped by their key head.
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    s = (q.float().view(b, hkv, hq // hkv, sq, d) @ k.float().unsqueeze(2).transpose(-1, -2)) * scale
    if kind == "causal":
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, _NEG_INF)
    elif kind == "masked":
        s = s.masked_fill(~mask[:, None, None], _NEG_INF)
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # Rows that see no key have lse = -inf; exp(-inf - 0) = 0 gives them zero probabilities.
    return lse.masked_fill(lse == _NEG_INF, 0.0)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kind: str, mask: torch.Tensor | None, scale: float,
    impl: str | None = None, drop: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over ``k, v`` for one block.

    ``drop``: attention dropout's fp32 ``[b, hq, sq, sk]`` factors (``1/(1-p)`` kept, 0 dropped) applied to the
    probabilities (the reference path); the log-sum-exp is of the undropped scores.

    Returns:
        ``(out, lse)``: ``out [b, hq, sq, d]`` fp32 and ``lse [b, hq, sq]`` fp32 (``-inf`` for rows
        that see no key).
    """
    impl = "reference" if drop is not None else impl or block_attention_impl(q.device, q.dtype, kind, q.shape[-1])
    groups = q.shape[1] // k.shape[1]
    if impl == "flash-cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, _expand_kv(k, groups), _expand_kv(v, groups), 0.0, kind == "causal", False, scale=scale)[:2]
        return out.float(), lse.float()
    if impl == "flash-cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _expand_kv(k, groups), _expand_kv(v, groups), 0.0, kind == "causal",
            attn_mask=_bias(mask, q.dtype) if kind == "masked" else None, scale=scale,
        )
        lse = lse.float()
        if kind == "masked":  # rows that see no key: the kernel says lse 0, the merge needs -inf
            lse = lse.masked_fill(~mask.any(-1)[:, None], _NEG_INF)
        return out.float(), lse
    b, hq, sq, d = q.shape
    s = _scores(q, k, kind, mask, scale)
    lse = s.logsumexp(-1)
    p = torch.exp(s - _finite(lse)[..., None])
    if drop is not None:
        p = p * drop.view(p.shape)
    out = p @ v.float().unsqueeze(2)
    return out.view(b, hq, sq, d), lse.view(b, hq, sq)


def block_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, *, kind: str, mask: torch.Tensor | None, scale: float, impl: str | None = None,
    drop: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the final output and statistics of its query rows.

    Args:
        dout, out: ``[b, hq, sq, d]``, the gradient and the *merged* output of these query rows.
        lse: ``[b, hq, sq]`` fp32, the *merged* log-sum-exp (finite for every row).
        delta: ``[b, hq, sq]`` fp32, ``(dout * out).sum(-1)`` (used by the reference path).
        drop: the forward's dropout factors of this block (see :func:`block_forward`), or None.

    Returns:
        ``(dq, dk, dv)`` in fp32, shaped like ``q``, ``k``, ``v``: this block's contributions.
    """
    impl = "reference" if drop is not None else impl or block_attention_impl(q.device, q.dtype, kind, q.shape[-1])
    groups = q.shape[1] // k.shape[1]
    if impl == "flash-cuda":
        cum_q, cum_k, seed, offset = _flash_cuda_placeholders(q.device, q.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.to(q.dtype).contiguous(), q, _expand_kv(k, groups), _expand_kv(v, groups),
            out.to(q.dtype).contiguous(), lse.contiguous(), cum_q, cum_k, q.shape[2], k.shape[2], 0.0,
            kind == "causal", seed, offset, scale=scale)
        return dq.float(), _reduce_kv(dk.float(), groups), _reduce_kv(dv.float(), groups)
    if impl == "flash-cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, _expand_kv(k, groups), _expand_kv(v, groups), out.to(q.dtype), lse, 0.0,
            kind == "causal", attn_mask=_bias(mask, q.dtype) if kind == "masked" else None, scale=scale,
        )
        return dq.float(), _reduce_kv(dk.float(), groups), _reduce_kv(dv.float(), groups)
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    s = _scores(q, k, kind, mask, scale)
    p = torch.exp(s - lse.view(b, hkv, groups, sq, 1))  # [b, hkv, g, sq, sk]
    do = dout.float().view(b, hkv, groups, sq, d)
    dp = do @ v.float().unsqueeze(2).transpose(-1, -2)
    if drop is None:
        dv = (p.transpose(-1, -2) @ do).sum(2)
    else:  # out = (p * drop) @ v: the dropped probabilities carry dV, and dP picks up the factors
        drop = drop.view(p.shape)
        dv = ((p * drop).transpose(-1, -2) @ do).sum(2)
        dp = dp * drop
    ds = p * (dp - delta.view(b, hkv, groups, sq, 1))
    dq = (ds @ k.float().unsqueeze(2)) * scale
    dk = (ds.transpose(-1, -2) @ q.float().view(b, hkv, groups, sq, d)).sum(2) * scale
    return dq.view(b, hq, sq, d), dk, dv


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's ``(block_out, block_lse)`` into the running fp32 ``(out, lse)`` in place.

    ``out [..., sq, d]`` starts at zeros and ``lse [..., sq]`` at ``-inf``; views may be passed to
    update some query rows only.
    """
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - safe).unsqueeze(-1))
    lse.copy_(new)


def _drop_factors(dropout: Any, q: torch.Tensor, positions: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
    # A block's dropout factors from its global positions (None without dropout).
    if dropout is None:
        return None
    return dropout.scale(q.shape[0], q.shape[1], *positions)


def attend_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list, out: torch.Tensor, lse: torch.Tensor, *,
    scale: float, impl: str | None, dropout: Any = None,
) -> None:
    """Attend ``q`` to one K/V block per ``(q slice, k slice, kind, mask builder, positions)`` of ``blocks``
    (:data:`~mg_parallel.context_parallel.plan.Block`) and merge each result into the running fp32
    ``out``, ``lse`` in place; ``dropout``: an :class:`~mg_parallel.context_parallel.dropout.AttentionDropout`."""
    for qs, ks, kind, build_mask, positions in blocks:
        mask = None if build_mask is None else build_mask()
        bo, bl = block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], kind=kind, mask=mask, scale=scale, impl=impl,
                               drop=_drop_factors(dropout, q, positions))
        merge_into(out[:, :, qs], lse[:, :, qs], bo, bl)


def attend_blocks_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, blocks: list, grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *, scale: float,
    impl: str | None, dropout: Any = None,
) -> None:
    """Backward of :func:`attend_blocks`: add every block's contributions to the fp32
    ``grads = (dq, dk, dv)`` (shaped like ``q``, ``k``, ``v``) in place."""
    dq, dk, dv = grads
    for qs, ks, kind, build_mask, positions in blocks:
        mask = None if build_mask is None else build_mask()
        bdq, bdk, bdv = block_backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs],
                                       lse[:, :, qs], delta[:, :, qs], kind=kind, mask=mask, scale=scale, impl=impl,
                                       drop=_drop_factors(dropout, q, positions))
        dq[:, :, qs] += bdq
        dk[:, :, ks] += bdk
        dv[:, :, ks] += bdv


def default_scale(head_dim: int, scale: float | None) -> float:
    """The softmax scale: ``scale`` if given, else ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
