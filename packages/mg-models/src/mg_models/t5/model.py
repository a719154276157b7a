"""T5Model: an encoder-decoder transformer (T5 v1.0 / v1.1) on mg-parallel layers.

* Pre-norm layers with T5's RMSNorm (no bias, no mean subtraction); ReLU (v1.0) or gated-GeLU
  (v1.1) MLP; no biases anywhere; attention scores are *not* scaled by 1/sqrt(d) (T5 folds that
  into the query init).
* A bucketed relative position bias (bidirectional in the encoder, causal in the decoder) is held
  by the first layer of each stack and shared by all its layers; cross-attention has none.
* Tied head: the decoder output is scaled by ``hidden_size ** -0.5`` before the shared embedding
  (``scale_decoder_output``, T5 v1.0); untied head: a separate ``output_layer.weight`` (v1.1).
* Heads, MLP width and vocabulary are split over tensor-parallel ranks; the relative bias table
  is replicated (each rank reads its heads' columns, so its grads are partial sums over tp and are
  tagged ``sequence_parallel`` for the tp all-reduce). Sequence parallelism is not supported for T5.
* Pipeline stages cut the encoder's layers, then the decoder's, into contiguous ranges
  (``layer_range`` over ``num_layers + decoder_layers``). The first stage embeds both the source and
  the decoder input; every stage sends ``[s_enc + s_dec, b, h]``: the encoder part (its output once
  the encoder is done, which decoder stages read for cross-attention and pass on) stacked on the
  decoder part. Every stage holds both relative position bias tables, tagged
  ``pipeline_replicated`` so their gradients are summed over the pipeline; a tied head on the last
  stage is its own ``output_layer.weight`` tagged ``shared_embedding``, as for GPT.
* The projection onto the vocabulary is ``head``, a :class:`~mg_models.heads.ParallelLMHead` without a
  weight of its own (it projects onto the word embedding or ``output_layer.weight``): its matmuls go
  through its GEMM recipe (``head.gemm``, :mod:`mg_parallel.gemm`) as the layers' go through theirs.
* :class:`T5DecoderCache` keeps decoder self-attention keys/values and the cross-attention
  keys/values of the encoder output for incremental decoding (:func:`greedy_generate`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mg_models.config import check_parallel
from mg_models.heads import ParallelLMHead
from mg_models.init import normal_init
from mg_models.layers import RMSNorm, TiedGradient, gelu_tanh, tied_embedding
from mg_models.spec import BuildContext
from mg_models.t5.config import T5Config
from mg_parallel.grid import ProcessGrid
from mg_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_tp_region,
    mark_replicated,
    vocab_parallel_cross_entropy,
)

__all__ = ["T5DecoderCache", "T5Model", "greedy_generate", "relative_position_bucket"]

WORD_EMBEDDING = "word_embeddings.weight"


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucket of each (key - query) offset: exact buckets for small offsets, log-spaced ones up to
    ``max_distance``; bidirectional uses half the buckets per direction, causal only looks back."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    # clamp(min=1) only avoids log(0); those positions take the exact branch anyway.
    log_ratio = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class T5DecoderCache:
    """Decoder keys/values for incremental decoding: per layer self-attention [b, heads/tp, t, d] (grown) and
    cross-attention [b, heads/tp, s_enc, d] (computed once). ``offset`` counts decoded positions."""

    def __init__(self) -> None:
        self.self_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cross_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.offset = 0


class T5Attention(nn.Module):
    """Unscaled multi-head attention (self or cross): q/k/v column-parallel (no bias), output row-parallel.

    ``forward(x [s, b, h], kv_input [s_k, b, h] | None, bias [b|1, heads/tp, s, s_k]) -> [s, b, h]``.
    """

    def __init__(self, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        c = ctx.config
        self.ctx = ctx
        self.heads = c.num_attention_heads // ctx.tp_size
        self.head_dim = c.kv_channels
        inner = c.num_attention_heads * c.kv_channels
        f = c.init_factor
        common = dict(tp_group=ctx.tp_group, bias=False, dtype=ctx.dtype, device=ctx.device)
        stds = {"linear_q": f * (c.hidden_size * c.kv_channels) ** -0.5, "linear_k": f * c.hidden_size ** -0.5,
                "linear_v": f * c.hidden_size ** -0.5}
        for name, std in stds.items():
            setattr(self, name, ColumnParallelLinear(c.hidden_size, inner, gather_output=False,
                                                     init_method=normal_init(ctx.seed, f"{prefix}.{name}.weight", std),
                                                     **common))
        self.linear_proj = RowParallelLinear(inner, c.hidden_size, input_is_parallel=True, init_method=normal_init(
            ctx.seed, f"{prefix}.linear_proj.weight", f * inner ** -0.5), **common)
        self.dropout = c.dropout

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        s, b = t.shape[:2]
        return t.view(s, b, self.heads, self.head_dim).permute(1, 2, 0, 3)  # [b, heads, s, d]

    def forward(self, x: torch.Tensor, kv_input: torch.Tensor | None, bias: torch.Tensor,
                cache: T5DecoderCache | None = None, layer: int = 0) -> torch.Tensor:
        """Self-attention when ``kv_input`` is None, else cross-attention to it; ``cache`` keeps keys/values of
        decoder ``layer`` (self: appended per step; cross: computed once)."""
        s, b = x.shape[:2]
        q = self._heads(self.linear_q(x))
        if kv_input is None:  # self-attention
            k, v = self._heads(self.linear_k(x)), self._heads(self.linear_v(x))
            if cache is not None:
                if layer in cache.self_kv:
                    past_k, past_v = cache.self_kv[layer]
                    k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
                cache.self_kv[layer] = (k, v)
        elif cache is not None and layer in cache.cross_kv:
            k, v = cache.cross_kv[layer]
        else:
            k, v = self._heads(self.linear_k(kv_input)), self._heads(self.linear_v(kv_input))
            if cache is not None:
                cache.cross_kv[layer] = (k, v)
        dropout = self.dropout if self.training else 0.0
        with self.ctx.tp_rng() if dropout > 0 else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout, scale=1.0)
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim))


class T5MLP(nn.Module):
    """``linear_fc2(relu(linear_fc1 x))`` or ``linear_fc2(gelu_tanh(linear_gate x) * linear_fc1 x)``; no biases."""

    def __init__(self, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        c = ctx.config
        self.gated = c.activation == "gated-gelu"
        common = dict(tp_group=ctx.tp_group, bias=False, dtype=ctx.dtype, device=ctx.device)
        std_in = c.init_factor * c.hidden_size ** -0.5
        for name in (["linear_gate", "linear_fc1"] if self.gated else ["linear_fc1"]):
            setattr(self, name, ColumnParallelLinear(c.hidden_size, c.ffn_hidden_size, gather_output=False,
                                                     init_method=normal_init(ctx.seed, f"{prefix}.{name}.weight",
                                                                             std_in), **common))
        self.linear_fc2 = RowParallelLinear(c.ffn_hidden_size, c.hidden_size, input_is_parallel=True, init_method=(
            normal_init(ctx.seed, f"{prefix}.linear_fc2.weight", c.init_factor * c.ffn_hidden_size ** -0.5)), **common)
        self.ctx, self.dropout = ctx, c.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s, b, h] -> [s, b, h]."""
        if self.gated:
            h = gelu_tanh(self.linear_gate(x)) * self.linear_fc1(x)
        else:
            h = F.relu(self.linear_fc1(x))
        if self.training and self.dropout > 0:
            with self.ctx.tp_rng():  # h is split over tp ranks: per-rank dropout stream
                h = F.dropout(h, self.dropout, training=True)
        return self.linear_fc2(h)


class T5Layer(nn.Module):
    """One pre-norm T5 layer: self-attention, (decoder) cross-attention, MLP, each ``x + drop(f(norm(x)))``."""

    def __init__(self, ctx: BuildContext, prefix: str, layer_number: int, decoder: bool) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.dropout = ctx.config.dropout
        self.input_layernorm = RMSNorm(ctx, f"{prefix}.input_layernorm")
        self.self_attention = T5Attention(ctx, f"{prefix}.self_attention")
        self.pre_cross_attn_layernorm = self.cross_attention = None
        if decoder:
            self.pre_cross_attn_layernorm = RMSNorm(ctx, f"{prefix}.pre_cross_attn_layernorm")
            self.cross_attention = T5Attention(ctx, f"{prefix}.cross_attention")
        self.pre_mlp_layernorm = RMSNorm(ctx, f"{prefix}.pre_mlp_layernorm")
        self.mlp = T5MLP(ctx, f"{prefix}.mlp")

    def _add(self, branch: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + (F.dropout(branch, self.dropout, training=True) if self.training and self.dropout else branch)

    def forward(self, x: torch.Tensor, self_bias: torch.Tensor, memory: torch.Tensor | None = None,
                cross_bias: torch.Tensor | None = None, cache: T5DecoderCache | None = None) -> torch.Tensor:
        """x [s, b, h]; memory: encoder output [s_enc, b, h] (decoder layers only)."""
        n = self.layer_number
        x = self._add(self.self_attention(self.input_layernorm(x), None, self_bias, cache, n), x)
        if self.cross_attention is not None:
            x = self._add(self.cross_attention(self.pre_cross_attn_layernorm(x), memory, cross_bias, cache, n), x)
        return self._add(self.mlp(self.pre_mlp_layernorm(x)), x)


class T5Stack(nn.Module):
    """Encoder or decoder stack with its relative position bias table ``relative_attention_bias`` [buckets, heads]
    (replicated; shared by all layers) and ``final_layernorm``.

    A pipeline stage holds the table and ``layers`` (the stack's global layer indices in ``layer_ids``, keyed by
    index); the stage with the stack's first layer applies the embedding dropout, the one with its last layer
    the final norm.
    """

    def __init__(self, ctx: BuildContext, prefix: str, decoder: bool, layer_ids: range | None = None, *,
                 pipeline_replicated: bool = False) -> None:
        super().__init__()
        c = ctx.config
        self.ctx, self.decoder = ctx, decoder
        n = c.decoder_layers if decoder else c.num_layers
        layer_ids = range(n) if layer_ids is None else layer_ids
        self.relative_attention_bias = nn.Embedding(c.relative_attention_num_buckets, c.num_attention_heads,
                                                    dtype=ctx.dtype, device=ctx.device)
        normal_init(ctx.seed, f"{prefix}.relative_attention_bias.weight", c.init_factor * c.hidden_size ** -0.5)(
            self.relative_attention_bias.weight)
        mark_replicated(self.relative_attention_bias)
        # Each tp rank reads only its heads' columns: grads are partial over tp (all-reduced like SP params).
        ctx.mark_partial_grads(self.relative_attention_bias, ctx.tp_size > 1)
        if pipeline_replicated:  # every stage holds it, whether or not it uses it: grads summed over pp
            self.relative_attention_bias.weight.pipeline_replicated = True
        self.layers = nn.ModuleDict({str(i): T5Layer(ctx, f"{prefix}.layers.{i}", i, decoder) for i in layer_ids})
        self.first = len(layer_ids) > 0 and layer_ids[0] == 0
        self.final_layernorm = None
        if len(layer_ids) > 0 and layer_ids[-1] == n - 1:
            self.final_layernorm = RMSNorm(ctx, f"{prefix}.final_layernorm")
        self.dropout = c.dropout

    def position_bias(self, q_len: int, k_len: int, offset: int, device: torch.device) -> torch.Tensor:
        """Relative position bias of this rank's heads: [1, heads/tp, q_len, k_len] (queries at offset..)."""
        c = self.ctx.config
        rel = torch.arange(k_len, device=device)[None, :] - torch.arange(offset, offset + q_len, device=device)[:, None]
        buckets = relative_position_bucket(rel, not self.decoder, c.relative_attention_num_buckets,
                                           c.relative_attention_max_distance)
        heads = c.num_attention_heads // self.ctx.tp_size
        table = self.relative_attention_bias.weight[:, self.ctx.tp_rank * heads:(self.ctx.tp_rank + 1) * heads]
        return F.embedding(buckets, table).permute(2, 0, 1)[None]  # [1, heads, q, k]

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None, memory: torch.Tensor | None = None,
                memory_mask: torch.Tensor | None = None, cache: T5DecoderCache | None = None) -> torch.Tensor:
        """x: embedded (or a previous stage's hidden) [s, b, h]; key_mask [b, k_len] (1 = token); memory/memory_mask:
        encoder output and its mask."""
        s = x.shape[0]
        offset = cache.offset if cache is not None else 0
        k_len = offset + s
        bias = self.position_bias(s, k_len, offset, x.device)
        neg = torch.finfo(bias.dtype).min
        if self.decoder:
            causal = torch.arange(k_len, device=x.device)[None, :] > torch.arange(offset, k_len, device=x.device)[:, None]
            bias = bias.masked_fill(causal, neg)
        if key_mask is not None:
            bias = bias + (1.0 - key_mask[:, None, None, :].to(bias.dtype)) * neg
        cross = None
        if memory is not None:
            cross = torch.zeros(1, 1, 1, memory.shape[0], dtype=bias.dtype, device=x.device)
            if memory_mask is not None:
                cross = (1.0 - memory_mask[:, None, None, :].to(bias.dtype)) * neg
        if self.first:
            x = self._drop(x)
        for layer in self.layers.values():
            x = layer(x, bias, memory, cross, cache)
        return self._drop(self.final_layernorm(x)) if self.final_layernorm is not None else x

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, training=True) if self.training and self.dropout > 0 else x


class T5Model(nn.Module):
    """T5 encoder-decoder on mg-parallel layers (see module docstring), or one pipeline stage of it.

    Args:
        config: the architecture.
        grid: the process grid (``ProcessGrid.single()`` when None); tp and pp.
        pre_process: this stage embeds the source and decoder tokens (first pipeline stage).
        post_process: this stage holds the decoder's head and returns the loss or logits (last stage).
        layer_range: global ``(start, end)`` over the encoder's layers followed by the decoder's
            (``num_layers + decoder_layers`` in all); None means all.
        seed: initialisation seed.
        rng_tracker: mg_parallel ``RNGTracker`` for attention dropout on tp-sharded heads.
        dtype: parameter dtype (fp32 when None).

    Raises:
        ValueError: tp does not divide the heads / MLP width / padded vocabulary (names the field), or a bad
            ``layer_range``.
    """

    tied_embedding_name = WORD_EMBEDDING
    """The parameter whose copy a tied head on a later pipeline stage holds as ``output_layer.weight``."""

    def __init__(self, config: T5Config, grid: ProcessGrid | None = None, *, pre_process: bool = True,
                 post_process: bool = True, layer_range: tuple[int, int] | None = None, seed: int = 1234,
                 rng_tracker: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(config, T5Config):
            raise ValueError(f"T5Model needs a T5Config, got {type(config).__name__}")
        grid = grid or ProcessGrid.single()
        check_parallel(config, grid.tp_size, grid.pp_size)
        enc_layers, total = config.num_layers, config.num_layers + config.decoder_layers
        start, end = layer_range if layer_range is not None else (0, total)
        if not 0 <= start < end <= total:
            raise ValueError(f"layer_range=({start}, {end}) must satisfy 0 <= start < end <= {total} (the encoder's "
                             f"and the decoder's layers)")
        tp = grid.tp_size
        self.config, self.grid = config, grid
        self.pre_process, self.post_process, self.layer_range = pre_process, post_process, (start, end)
        self.ctx = BuildContext(config=config, tp_group=grid.tp_group, tp_size=tp, tp_rank=grid.tp_rank, seed=seed,
                                rng_tracker=rng_tracker, device=grid.device, dtype=dtype)
        self.input_tensor: torch.Tensor | None = None
        self.gather_logits_default = False
        """When True, forward returns full unpadded logits unless told otherwise (set by load_hf_t5)."""
        staged = not (pre_process and post_process)
        self.word_embeddings = None
        if pre_process:
            self.word_embeddings = VocabParallelEmbedding(
                config.padded_vocab_size, config.hidden_size, tp_group=grid.tp_group,
                init_method=normal_init(seed, WORD_EMBEDDING, config.init_factor), dtype=dtype, device=grid.device)
        replicated = grid.pp_size > 1
        self.encoder = T5Stack(self.ctx, "encoder", decoder=False, layer_ids=range(start, min(end, enc_layers)),
                               pipeline_replicated=replicated)
        self.decoder = T5Stack(self.ctx, "decoder", decoder=True,
                               layer_ids=range(max(start - enc_layers, 0), max(end - enc_layers, 0)),
                               pipeline_replicated=replicated)
        self.output_layer = None
        self.head = ParallelLMHead(self.ctx, None) if post_process else None
        """The vocabulary projection (its weight is the word embedding's or ``output_layer.weight``)."""
        tied = config.tie_word_embeddings
        if post_process and (not tied or not pre_process):  # only its weight [V_pad/tp, h] is used, as the head
            init = normal_init(seed, WORD_EMBEDDING, config.init_factor) if tied else normal_init(
                seed, "output_layer.weight", config.init_factor * config.hidden_size ** -0.5)
            self.output_layer = VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size,
                                                       tp_group=grid.tp_group, init_method=init, dtype=dtype,
                                                       device=grid.device)
        if tied and staged:  # the first stage's embedding and the last stage's head: one tied weight
            for module in (self.word_embeddings, self.output_layer):
                if module is not None:
                    module.weight.shared_embedding = True

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """Pipeline hook: the [s_enc + s_dec, b, h] hidden states this (non-first) stage starts from."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0] if input_tensor else None
        self.input_tensor = input_tensor

    def _whole(self, what: str) -> None:
        if not (self.pre_process and self.post_process):
            raise ValueError(f"T5Model.{what} needs the whole model (pre_process and post_process), not a pipeline "
                             f"stage; call the stage's forward")

    def _embed(self, ids: torch.Tensor, tied: TiedGradient | None = None) -> torch.Tensor:
        if tied is not None:
            return tied_embedding(ids.t(), self.word_embeddings.weight, tied)  # [s, b, h]
        return self.word_embeddings(ids.t())  # [s, b, h]

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder output [s, b, h] for ids [b, s] (``attention_mask`` [b, s]: 1 = token, 0 = padding)."""
        self._whole("encode")
        return self.encoder(self._embed(input_ids), attention_mask)

    def new_decoder_cache(self) -> T5DecoderCache:
        """An empty key/value cache for incremental :meth:`decode` calls (what generation passes as ``cache``)."""
        return T5DecoderCache()

    def decode(self, decoder_input_ids: torch.Tensor, encoder_output: torch.Tensor,
               attention_mask: torch.Tensor | None = None, decoder_attention_mask: torch.Tensor | None = None, *,
               labels: torch.Tensor | None = None, gather_logits: bool | None = None,
               cache: T5DecoderCache | None = None) -> torch.Tensor:
        """Decoder logits [b, t, V_pad/tp] (or [b, t, vocab] gathered), or the per-token loss [b, t] with ``labels``.

        With ``cache`` only the new decoder tokens are passed; earlier ones come from the cache.
        """
        self._whole("decode")
        if cache is not None and decoder_attention_mask is not None:
            raise ValueError("decoder_attention_mask is not supported with a cache; decoding is left-aligned")
        x = self.decoder(self._embed(decoder_input_ids), decoder_attention_mask, encoder_output, attention_mask, cache)
        if cache is not None:
            cache.offset += decoder_input_ids.shape[1]
        return self._head(x, labels, gather_logits, None)

    def _head(self, x: torch.Tensor, labels: torch.Tensor | None, gather_logits: bool | None,
              tied: TiedGradient | None) -> torch.Tensor:
        """Decoder output [t, b, h] -> logits [b, t, V_pad/tp] (or gathered), or the per-token loss [b, t]."""
        c = self.config
        if c.scale_output:
            x = x * c.hidden_size ** -0.5
        weight = self.word_embeddings.weight if self.output_layer is None else self.output_layer.weight
        if tied is not None:
            logits = self.head.tied_projection(x, weight, None, tied)  # [t, b, V_pad]
        else:
            logits = self.head(x, weight)  # [t, b, V_pad/tp]
        if labels is not None:
            loss = vocab_parallel_cross_entropy(logits.float(), labels.t(), tp_group=self.ctx.tp_group,
                                                vocab_size=c.vocab_size)
            return loss.t()
        logits = logits.transpose(0, 1)
        if gather_logits if gather_logits is not None else self.gather_logits_default:
            logits = gather_from_tp_region(logits.contiguous(), self.ctx.tp_group)[..., : c.vocab_size]
        return logits

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, decoder_attention_mask: torch.Tensor | None = None, *,
                labels: torch.Tensor | None = None,
                gather_logits: bool | None = None) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """Encode ``input_ids`` [b, s] and decode ``decoder_input_ids`` [b, t] (teacher forcing); every pipeline
        stage takes the same arguments (the first reads the ids, every stage the masks and lengths, the last
        ``labels``).

        Returns:
            The last stage: ``(logits_or_loss, encoder_output)``: decoder logits [b, t, V_pad/tp] ([b, t, vocab]
            when gathered) or, with ``labels`` [b, t] (-100 = ignore), the per-token loss [b, t] (fp32); encoder
            output [s, b, h]. Another stage: the hidden states [s + t, b, h] it sends on.

        Raises:
            ValueError: a non-first stage without ``set_input_tensor``, or an input tensor whose length is not
                s + t.
        """
        s, t = input_ids.shape[1], decoder_input_ids.shape[1]
        tied = None
        if self.pre_process:
            if (self.post_process and self.output_layer is None and self.ctx.tp_size == 1
                    and torch.is_grad_enabled()):
                tied = TiedGradient()  # both lookups and the head share one weight: one [V, h] gradient
            memory, x = self._embed(input_ids, tied), self._embed(decoder_input_ids, tied)
        else:
            if self.input_tensor is None:
                raise ValueError("a non-first pipeline stage needs set_input_tensor(hidden) before forward")
            if self.input_tensor.shape[0] != s + t:
                raise ValueError(f"the input tensor holds {self.input_tensor.shape[0]} positions but the source and "
                                 f"decoder inputs {s} + {t}")
            memory, x = self.input_tensor[:s], self.input_tensor[s:]
        if self.encoder.layers:
            memory = self.encoder(memory, attention_mask)
        if self.decoder.layers:
            x = self.decoder(x, decoder_attention_mask, memory, attention_mask)
        if not self.post_process:
            return torch.cat([memory, x])
        return self._head(x, labels, gather_logits, tied), memory


@torch.no_grad()
def greedy_generate(model: T5Model, input_ids: torch.Tensor, max_new_tokens: int, *, decoder_start_token_id: int = 0,
                    attention_mask: torch.Tensor | None = None, use_cache: bool = True) -> torch.Tensor:
    """Greedy decoding: [b, s] source ids -> [b, 1 + max_new_tokens] decoder ids (starting with the start token).

    ``use_cache=False`` recomputes the whole decoder prefix every step (the reference for the cache).
    """
    memory = model.encode(input_ids, attention_mask)
    out = torch.full((input_ids.shape[0], 1), decoder_start_token_id, dtype=torch.long, device=input_ids.device)
    cache = T5DecoderCache() if use_cache else None
    for _ in range(max_new_tokens):
        step_ids = out[:, -1:] if use_cache else out
        logits = model.decode(step_ids, memory, attention_mask, gather_logits=True, cache=cache)
        out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out
