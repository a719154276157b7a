"""Transformer building blocks on mg-parallel layers: norms, rotary embedding, MLP, attention.

Activations are ``[seq, batch, hidden]``. Under sequence parallelism the residual stream is
``[seq/tp, batch, hidden]``; column-parallel layers gather it and row-parallel layers
reduce-scatter back, so norms and dropout act on the local sequence chunk.

Fused QKV uses Megatron's grouped layout: output rows are ordered per key/value group as
``[q heads of group g, k_g, v_g]``, so a contiguous tp shard holds whole groups and the global
weight is the same at every tp.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mg_models.init import normal_init, scaled_std
from mg_models.spec import BuildContext, ModuleSpec, build_module
from mg_parallel.gemm import PLAIN_GEMM, Gemm
from mg_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, mark_replicated

__all__ = [
    "MLP",
    "LayerNorm",
    "MLPSubmodules",
    "ContextParallelMask",
    "RMSNorm",
    "RotaryEmbedding",
    "SelfAttention",
    "SelfAttentionSubmodules",
    "TiedGradient",
    "apply_rotary",
    "check_context_parallel",
    "gelu_tanh",
    "norm_class",
    "rotary_frequencies",
    "tied_embedding",
    "tied_projection",
]


class LayerNorm(nn.LayerNorm):
    """LayerNorm over the last dim with the config's eps; weight 1, bias 0 (replicated over tp)."""

    def __init__(self, ctx: BuildContext, prefix: str, dim: int | None = None) -> None:
        super().__init__(dim or ctx.config.hidden_size, eps=ctx.config.norm_eps, device=ctx.device, dtype=ctx.dtype)
        mark_replicated(self)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Llama): normalised in fp32, cast back, then scaled by the weight (replicated
    over tp)."""

    def __init__(self, ctx: BuildContext, prefix: str, dim: int | None = None) -> None:
        super().__init__()
        self.eps = ctx.config.norm_eps
        self.weight = nn.Parameter(torch.ones(dim or ctx.config.hidden_size, device=ctx.device, dtype=ctx.dtype))
        mark_replicated(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> same shape and dtype (torch's fused ``F.rms_norm`` kernel on CUDA)."""
        x32 = x.float()
        if x.is_cuda:
            x32 = F.rms_norm(x32, (x32.shape[-1],), eps=self.eps)
        else:
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def norm_class(ctx: BuildContext) -> type[nn.Module]:
    """The norm module chosen by ``config.normalization``."""
    return RMSNorm if ctx.config.normalization == "rmsnorm" else LayerNorm


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context ``factor`` times longer: ``0.1 * mscale * ln(factor) + 1``."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(powers: torch.Tensor, rotary_dim: int, base: float, p: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN ("NTK-by-parts" interpolation plus attention temperature, Peng et al. 2023); ``powers`` are
    ``base ** (2i / rotary_dim)``, the inverse of plain rotary's frequencies."""
    factor, original = p["factor"], p["original_max_position_embeddings"]
    beta_fast, beta_slow = p.get("beta_fast") or 32.0, p.get("beta_slow") or 1.0

    def dim_of(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if high == low:
        high += 0.001
    # Weight of the original (extrapolated) frequency: 1 for fast dimensions, 0 for slow ones, linear between.
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    scaled = 1.0 / (factor * powers) * (1 - keep) + 1.0 / powers * keep
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = _mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all else _mscale(factor)
    return scaled, float(attention)


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths (beyond original / low_freq_factor) slowed by ``factor``, short ones
    (below original / high_freq_factor) kept, and a linear blend in wavelength-count between."""
    factor, low, high, original = (p["factor"], p["low_freq_factor"], p["high_freq_factor"],
                                   p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)  # 0 at the long end of the band, 1 at the short end
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original / low, inv_freq / factor, blended)
    return torch.where(wavelen < original / high, inv_freq, out)


def rotary_frequencies(rotary_dim: int, base: float, scaling: dict[str, Any] | None = None,
                       seq_len: int | None = None, max_position_embeddings: int | None = None
                       ) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies and the factor on cos/sin, computed on the CPU in fp32 (as Hugging Face does).

    Args:
        rotary_dim: rotated dimensions per head (even).
        base: rotary base (theta).
        scaling: a validated ``GPTConfig.rotary_scaling`` (type linear, dynamic, llama3 or yarn), or None.
        seq_len: dynamic scaling only: the length being run (max position + 1); it rescales the base once it
            exceeds ``max_position_embeddings`` (needed then).

    Returns:
        ``(inv_freq [rotary_dim / 2] fp32, attention_factor)``; the factor (YaRN's temperature) multiplies cos and
        sin and is 1.0 for the other types.
    """
    kind = scaling["type"] if scaling else None
    if kind == "dynamic" and seq_len is not None and max_position_embeddings and seq_len > max_position_embeddings:
        # NTK-aware base growth: keeps the slowest dimension within the seen range at seq_len.
        factor = scaling["factor"]
        base = base * (factor * seq_len / max_position_embeddings - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    powers = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    if kind == "yarn":
        return _yarn(powers, rotary_dim, base, scaling)
    inv_freq = 1.0 / powers
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Rotary position embedding tables (half-split "rotate_half" convention, as Hugging Face Llama).

    ``forward(position_ids [b, s]) -> (cos, sin)``, each ``[s, b, 1, rotary_dim]`` in fp32. Angles are
    ``position * inv_freq`` in fp32 from int64 positions (exact up to 2**24), as Hugging Face computes them.

    Args:
        rotary_dim: rotated dimensions per head.
        base: rotary base (theta).
        device: where the tables live.
        scaling: ``GPTConfig.rotary_scaling`` (validated), or None for plain rotary.
        max_position_embeddings: the length beyond which dynamic scaling starts (``GPTConfig.max_position_embeddings``).
    """

    def __init__(self, rotary_dim: int, base: float, device: torch.device | None = None,
                 scaling: dict[str, Any] | None = None, max_position_embeddings: int | None = None) -> None:
        super().__init__()
        self.rotary_dim, self.base, self.scaling = rotary_dim, base, scaling
        self.max_position_embeddings = max_position_embeddings
        inv_freq, self.attention_factor = rotary_frequencies(rotary_dim, base, scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def _inv_freq(self, position_ids: torch.Tensor) -> torch.Tensor:
        if self.inv_freq.dtype != torch.float32:  # cast with the model (model.to(torch.bfloat16)): back to fp32
            self.inv_freq = rotary_frequencies(self.rotary_dim, self.base, self.scaling)[0].to(self.inv_freq.device)
        dynamic = self.scaling is not None and self.scaling["type"] == "dynamic"
        seq_len = int(position_ids.max()) + 1 if dynamic and position_ids.numel() else None
        if seq_len is not None and seq_len > self.max_position_embeddings:  # a longer run: dynamic NTK's base
            inv_freq, _ = rotary_frequencies(self.rotary_dim, self.base, self.scaling, seq_len,
                                             self.max_position_embeddings)
            return inv_freq.to(self.inv_freq.device)
        return self.inv_freq

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [b, s] (integers) -> (cos, sin), each [s, b, 1, rotary_dim] fp32."""
        freqs = position_ids.t().float()[..., None] * self._inv_freq(position_ids)  # [s, b, rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [s, b, 1, rot]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading ``cos.shape[-1]`` dims of x [s, b, heads, d]; the rest pass through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


class _GeluTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GeLU's tanh approximation, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, elementwise, same shape and dtype.

    In fp32 the formula is evaluated op by op in the order of the GPT-2 reference code, which
    Hugging Face's ``gelu_new`` (GPT-2, BERT, T5 v1.1 "gated-gelu") follows, so converted models give
    bit-identical activations; torch's fused ``F.gelu(x, approximate="tanh")`` rounds differently,
    which a T5 v1.1 amplifies to ~1e-5 on its logits. Only the input is kept for backward, which is
    torch's fused derivative. Other dtypes use the fused kernel: it computes in fp32 and rounds once.
    """
    if x.dtype != torch.float32:
        return F.gelu(x, approximate="tanh")
    return _GeluTanh.apply(x)


@dataclass
class MLPSubmodules:
    """Linear layer classes of the MLP."""

    linear_fc1: type = ColumnParallelLinear
    linear_fc2: type = RowParallelLinear


class MLP(nn.Module):
    """Feed-forward block: GeLU (``linear_fc1`` -> act -> ``linear_fc2``) or SwiGLU
    (``silu(linear_gate(x)) * linear_fc1(x)`` -> ``linear_fc2``, gate and up as separate column-parallel
    linears so their global weights do not depend on tp). x [s(/tp), b, h] -> same shape."""

    def __init__(self, ctx: BuildContext, prefix: str, submodules: MLPSubmodules | None = None) -> None:
        super().__init__()
        sub = submodules or MLPSubmodules()
        c = ctx.config
        self.activation = c.activation
        common = dict(tp_group=ctx.tp_group, bias=c.add_bias_linear, sequence_parallel=ctx.sequence_parallel,
                      dtype=ctx.dtype, device=ctx.device)
        std = c.init_method_std
        names = ["linear_gate", "linear_fc1"] if c.activation == "swiglu" else ["linear_fc1"]
        for name in names:
            setattr(self, name, sub.linear_fc1(c.hidden_size, c.ffn_size, gather_output=False,
                                               init_method=normal_init(ctx.seed, f"{prefix}.{name}.weight", std),
                                               **common))
        out_std = scaled_std(std, c.num_layers) if c.scaled_output_init else std
        self.linear_fc2 = sub.linear_fc2(c.ffn_size, c.hidden_size, input_is_parallel=True,
                                         init_method=normal_init(ctx.seed, f"{prefix}.linear_fc2.weight", out_std),
                                         **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            h = F.silu(self.linear_gate(x)) * self.linear_fc1(x)
        else:
            h = self.linear_fc1(x)
            h = gelu_tanh(h) if self.activation == "gelu_tanh" else F.gelu(h)
        return self.linear_fc2(h)


@dataclass(frozen=True)
class ContextParallelMask:
    """What restricts attention when the sequence is split over the context-parallel group (``ctx.cp_size > 1``),
    passed where a boolean mask goes otherwise: attention is causal, plus these."""

    window: int | None = None
    """Sliding window (``model.sliding_window``): a query sees keys at distance ``< window``; None: no window."""
    document_ids: torch.Tensor | None = None
    """``[b, s/cp]`` document of each of this rank's tokens (packed sequences, split like the tokens), or None."""


@dataclass
class SelfAttentionSubmodules:
    """Parts of the attention block; q/k layernorm are None unless ``qk_layernorm``."""

    linear_qkv: type = ColumnParallelLinear
    linear_proj: type = RowParallelLinear
    q_layernorm: ModuleSpec | type | None = None
    k_layernorm: ModuleSpec | type | None = None


class SelfAttention(nn.Module):
    """Causal multi-head / grouped-query self-attention via ``scaled_dot_product_attention``.

    Heads and query groups are split over tp ranks (each rank holds whole groups). Supports
    rotary embeddings, an explicit boolean mask ``[b, 1, s_q, s_k]`` (True = attend) and a KV
    cache for incremental decoding.

    With ``ctx.cp_size > 1`` the rank holds its load-balanced part of the sequence (chunks ``r`` and
    ``2cp-1-r``) and attends to the whole sequence through
    :func:`mg_parallel.context_parallel.context_parallel_attention` over ``ctx.cp_group`` (``ctx.cp_comm``);
    the mask is then a :class:`ContextParallelMask` or None, there is no KV cache, and attention dropout
    keeps the probabilities that a hash of their global coordinates keeps
    (:mod:`mg_parallel.context_parallel.dropout`; the seed of each call drawn from the tensor-parallel
    stream, so recomputation replays it).

    Raises:
        ValueError: (construction) ``cp_comm="a2a"`` with attention dropout, or with heads or query groups per tp
            rank not divisible by cp.
    """

    def __init__(self, ctx: BuildContext, prefix: str, layer_number: int,
                 submodules: SelfAttentionSubmodules | None = None) -> None:
        super().__init__()
        sub = submodules or SelfAttentionSubmodules()
        c = ctx.config
        self.ctx = ctx
        self.layer_number = layer_number
        self.head_dim = c.head_dim
        self.heads = c.num_attention_heads // ctx.tp_size
        self.groups = c.query_groups // ctx.tp_size
        self.q_per_group = c.num_attention_heads // c.query_groups
        self.dropout = c.attention_dropout
        check_context_parallel(c, ctx.tp_size, ctx.cp_size, ctx.cp_comm)
        qkv_out = (c.num_attention_heads + 2 * c.query_groups) * c.head_dim
        common = dict(tp_group=ctx.tp_group, sequence_parallel=ctx.sequence_parallel, dtype=ctx.dtype,
                      device=ctx.device)
        self.linear_qkv = sub.linear_qkv(
            c.hidden_size, qkv_out, bias=c.qkv_bias, gather_output=False,
            init_method=normal_init(ctx.seed, f"{prefix}.linear_qkv.weight", c.init_method_std), **common)
        out_std = scaled_std(c.init_method_std, c.num_layers) if c.scaled_output_init else c.init_method_std
        self.linear_proj = sub.linear_proj(
            c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.add_bias_linear, input_is_parallel=True,
            init_method=normal_init(ctx.seed, f"{prefix}.linear_proj.weight", out_std), **common)
        self.q_layernorm = self.k_layernorm = None
        if sub.q_layernorm is not None:
            self.q_layernorm = build_module(sub.q_layernorm, ctx, f"{prefix}.q_layernorm", dim=c.head_dim)
            self.k_layernorm = build_module(sub.k_layernorm, ctx, f"{prefix}.k_layernorm", dim=c.head_dim)
            # Shared across heads, which are split over tp: grads are partial sums over tp ranks.
            ctx.mark_partial_grads(self.q_layernorm, ctx.tp_size > 1 or ctx.sequence_parallel)
            ctx.mark_partial_grads(self.k_layernorm, ctx.tp_size > 1 or ctx.sequence_parallel)

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
                        dropout: float, is_causal: bool) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v with dropout: q [b, heads, s, d], k/v [b, heads, s_k, d] -> [b, heads, s, d].
        Under context parallelism k/v keep their groups ([b, groups, s, d]) and ``mask`` is a ContextParallelMask."""
        if self.ctx.cp_size > 1:
            from mg_parallel.context_parallel import context_parallel_attention

            cp_mask = mask or ContextParallelMask()
            drop: dict[str, Any] = {}
            if dropout > 0:  # hashed masks (layout-independent); the seed drawn from this rank's heads' stream
                with self.ctx.tp_rng():
                    seed = torch.randint(0, 2**62, (), device=q.device)
                drop = dict(dropout_p=dropout, dropout_seed=seed, head_offset=self.ctx.tp_rank * self.heads)
            return context_parallel_attention(q, k, v, group=self.ctx.cp_group, comm=self.ctx.cp_comm, causal=True,
                                              window=cp_mask.window, document_ids=cp_mask.document_ids, **drop)
        # Attention dropout acts on this rank's heads, so it draws from the per-tp-rank stream.
        with self.ctx.tp_rng() if dropout > 0 else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | ContextParallelMask | None = None, cache: object | None = None) -> torch.Tensor:
        """x [s(/tp), b, h] -> [s(/tp), b, h]. ``cache`` is an :class:`~mg_models.generation.InferenceCache`; ``mask``
        a boolean mask, or a :class:`ContextParallelMask` at ``ctx.cp_size > 1``.

        Raises:
            ValueError: at cp > 1, a KV cache or a dense mask.
        """
        qkv = self.linear_qkv(x)  # [s, b, groups * (q_per_group + 2) * d]
        s, b = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(s, b, self.groups, self.q_per_group + 2, self.head_dim)
        # split (not indexing): its backward is one concatenation instead of three zero-filled scatters.
        q, k, v = qkv.split([self.q_per_group, 1, 1], dim=3)
        q = q.reshape(s, b, self.heads, self.head_dim)  # a view for multi-head attention
        k, v = k.squeeze(3), v.squeeze(3)  # [s, b, groups, d]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads|groups, s, d]
        if cache is not None:
            if self.ctx.cp_size > 1:
                raise ValueError("incremental decoding (a KV cache) is not supported with parallel.cp > 1")
            k, v = cache.update(self.layer_number, k, v)  # [b, groups, offset + s, d]
        if self.ctx.cp_size > 1:
            if mask is not None and not isinstance(mask, ContextParallelMask):
                raise ValueError("with parallel.cp > 1 attention takes a ContextParallelMask (window, document ids), "
                                 "not a dense mask")
        elif self.groups != self.heads:
            # Query head j uses key/value group j // q_per_group (grouped layout).
            k = k.repeat_interleave(self.q_per_group, dim=1)
            v = v.repeat_interleave(self.q_per_group, dim=1)
        dropout = self.dropout if self.training else 0.0
        is_causal = mask is None and s > 1 and k.shape[2] == s
        rc = self.ctx.recompute
        if rc is not None and rc.recompute_core_attention and self.training and torch.is_grad_enabled():
            from mg_parallel.recompute import recompute

            out = recompute(self._core_attention, q, k, v, mask, dropout, is_causal, rng_tracker=self.ctx.rng_tracker)
        else:
            out = self._core_attention(q, k, v, mask, dropout, is_causal)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)  # [s, b, heads*d]
        return self.linear_proj(out)


def check_context_parallel(config: Any, tp: int, cp: int, comm: str) -> None:
    """Check that GPT attention of ``config`` can run with the sequence split over ``cp`` ranks (no collective).

    Args:
        config: a ``GPTConfig``.
        tp, cp: tensor- and context-parallel sizes.
        comm: ``parallel.cp_comm`` (``"a2a"`` splits each tp rank's heads and query groups over cp).

    Raises:
        ValueError: naming the keys: attention dropout with ``a2a``, or ``a2a`` with heads or query groups per tp
            rank not divisible by cp.
    """
    if cp == 1:
        return
    if config.attention_dropout > 0 and comm == "a2a":
        raise ValueError(f"model.attention_dropout={config.attention_dropout} is not supported with parallel.cp_comm=a2a "
                         f"(its heads run SDPA, whose dropout depends on the layout); use parallel.cp_comm: p2p or "
                         f"allgather, or set it to 0")
    heads, groups = config.num_attention_heads // tp, config.query_groups // tp
    if comm == "a2a" and (heads % cp or groups % cp):
        raise ValueError(
            f"parallel.cp_comm=a2a splits each tp rank's {heads} attention heads and {groups} query groups "
            f"(model.num_attention_heads, model.num_query_groups / parallel.tp) over parallel.cp={cp}; both must be "
            f"divisible by it (or use parallel.cp_comm: p2p or allgather)")


class TiedGradient:
    """Lets tied word-embedding lookups add their gradient into the output projection's, in place.

    With tied weights, autograd gives the table one dense ``[V, h]`` gradient per use (the
    projection's, and each lookup's although only the looked-up rows are non-zero), then adds
    them into fresh ``[V, h]`` tensors. :func:`tied_projection` hands its weight gradient to this
    object and each :func:`tied_embedding` of the same forward (whose backward runs later in the
    same pass, being upstream of the projection) adds its rows into that tensor and returns no
    gradient of its own, so one ``[V, h]`` tensor is written instead of several. Use one object
    per forward pass, with the very same weight tensor in every call.
    """

    def __init__(self) -> None:
        self._grad: torch.Tensor | None = None
        self._task = -1
        self._pending = 0
        self._lookups = 0
        self.weight: torch.Tensor | None = None
        """The table the lookups read (the projection fuses only with that very tensor)."""

    def bind(self, weight: torch.Tensor) -> None:
        """Record a lookup of ``weight`` (forward of :func:`tied_embedding`).

        Raises:
            ValueError: an earlier lookup of this object used another tensor.
        """
        if self.weight is not None and self.weight is not weight:
            raise ValueError("one TiedGradient serves one weight tensor; create one per tied table and forward")
        self.weight = weight
        self._lookups += 1

    def stash(self, grad: torch.Tensor) -> None:
        """Keep the projection's weight gradient for the lookups' backward in the same pass."""
        self._grad, self._task, self._pending = grad, torch._C._current_graph_task_id(), self._lookups

    def take(self) -> torch.Tensor | None:
        """The stashed gradient if it belongs to the running backward pass, else None. The last lookup
        releases it, so autograd can hand that tensor to ``.grad`` without a copy."""
        grad = self._grad
        if grad is None or self._task != torch._C._current_graph_task_id():
            return None
        self._pending -= 1
        if self._pending <= 0:
            self._grad = None
        return grad


class _TiedProjection(torch.autograd.Function):
    """``x @ weight.T + bias`` with the recipe's ``linear``; backward: the input and weight gradients with its
    ``mm`` (the weight's handed to the :class:`TiedGradient`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                tied: TiedGradient, gemm: Gemm) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.tied = tied if tied.weight is weight else None
        ctx.has_bias = bias is not None
        ctx.gemm = gemm
        return gemm.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        gemm = ctx.gemm
        grad2 = grad.reshape(-1, grad.shape[-1])  # [n, V]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # [n, V] @ [V, h]: what grad.matmul(weight) computes (it folds the leading dims into one).
            grad_x = gemm.mm(grad2, weight).view(*grad.shape[:-1], weight.shape[-1])
        if ctx.needs_input_grad[1]:
            # [V, n] @ [n, h]: a fresh contiguous [V, h] the embedding backward may add into in place.
            grad_w = gemm.mm(grad2.t(), x.reshape(-1, x.shape[-1]))
            if ctx.tied is not None:
                ctx.tied.stash(grad_w)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad2.sum(0)
        return grad_x, grad_w, grad_b, None, None


class _TiedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, tied: TiedGradient) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.tied, ctx.rows = tied, weight.shape[0]
        tied.bind(weight)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor | None, None]:
        (ids,) = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1])
        target = ctx.tied.take()
        if target is not None:
            target.index_add_(0, ids.reshape(-1), grad.to(target.dtype))
            return None, None, None  # already part of the projection's gradient of the same weight
        return None, grad.new_zeros(ctx.rows, grad.shape[-1]).index_add_(0, ids.reshape(-1), grad), None


def tied_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    tied: TiedGradient, *, gemm: Gemm = PLAIN_GEMM) -> torch.Tensor:
    """``x @ weight.T + bias`` (x [..., h], weight [V, h] -> [..., V]) whose weight gradient
    :func:`tied_embedding` of the same pass completes in place (see :class:`TiedGradient`).

    Its matmuls are ``gemm``'s: ``linear`` forward, ``mm`` for the input and weight gradients (the plain
    recipe computes exactly ``F.linear`` and its gradients)."""
    return _TiedProjection.apply(x, weight, bias, tied, gemm)


def tied_embedding(ids: torch.Tensor, weight: torch.Tensor, tied: TiedGradient) -> torch.Tensor:
    """``F.embedding(ids, weight)`` (ids [...] -> [..., h]) whose backward adds its rows into the gradient
    :func:`tied_projection` produced for the same ``weight`` in the same pass, when there is one; otherwise
    it returns an ordinary dense gradient."""
    return _TiedEmbedding.apply(ids, weight, tied)
