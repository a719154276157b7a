"""BertModel: a bidirectional encoder with the masked-LM and binary (next-sentence / sentence-order) heads.

Built from the same blocks as the GPT family (:class:`~mg_models.layers.SelfAttention`,
:class:`~mg_models.layers.MLP`, :class:`~mg_models.transformer.TransformerBlock`) on mg-parallel
layers, so it runs under tensor, sequence and pipeline parallelism:

* post-LN layers as the original BERT (``x = LN(x + attn(x)); x = LN(x + mlp(x))``, embedding
  LayerNorm) or, with ``pre_layernorm=True``, pre-LN layers with a final LayerNorm;
* attention is never causal; a padding ``attention_mask`` [b, s] (1 = token, 0 = pad) masks keys;
* the MLM head is dense -> gelu -> LayerNorm -> logits against the (tied) word embedding plus a
  vocabulary-sharded output bias; the binary head is a tanh pooler on ``[CLS]`` (position 0) and
  a linear layer to 2 classes;
* ``head="classification"`` builds, instead of both, the pooler, dropout and a ``classifier`` to
  ``num_labels`` classes (Hugging Face's ``BertForSequenceClassification``);
* parameter values derive from ``(seed, global name)``, so every layout holds slices of the same
  global tensors;
* every matmul goes through a GEMM recipe (:mod:`mg_parallel.gemm`): the layers', the heads' linears'
  (``lm_head.dense``, ``pooler``, ``binary_head``, ``classifier``) and the vocabulary projection's
  (``output_layer.gemm``, tied or not).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mg_models.bert.config import BertConfig
from mg_models.heads import (
    WORD_EMBEDDING,
    ParallelLMHead,
    classification_loss,
    full_sequence,
    replicated_linear,
)
from mg_models.init import normal_init
from mg_models.layers import (
    MLP,
    LayerNorm,
    SelfAttention,
    TiedGradient,
    gelu_tanh,
    tied_embedding,
)
from mg_models.spec import BuildContext, ModuleSpec
from mg_models.stage import PipelineStageModel
from mg_models.transformer import TransformerBlock, gpt_layer_spec
from mg_parallel.grid import ProcessGrid
from mg_parallel.tensor_parallel import (
    VocabParallelEmbedding,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    mark_replicated,
    scatter_to_sequence_parallel_region,
    set_tensor_parallel,
    vocab_parallel_cross_entropy,
)

__all__ = ["BertLayer", "BertModel"]


class BertLayer(nn.Module):
    """A post-LN encoder layer: ``x = LN(x + attn(x))`` then ``x = LN(x + mlp(x))``; x [s(/tp), b, h]."""

    def __init__(self, ctx: BuildContext, prefix: str, layer_number: int) -> None:
        super().__init__()
        self.ctx = ctx
        self.hidden_dropout = ctx.config.hidden_dropout
        self.self_attention = SelfAttention(ctx, f"{prefix}.self_attention", layer_number)
        self.post_attention_layernorm = LayerNorm(ctx, f"{prefix}.post_attention_layernorm")
        self.mlp = MLP(ctx, f"{prefix}.mlp")
        self.post_mlp_layernorm = LayerNorm(ctx, f"{prefix}.post_mlp_layernorm")
        for norm in (self.post_attention_layernorm, self.post_mlp_layernorm):
            ctx.mark_partial_grads(norm, ctx.sequence_parallel)

    def _dropout_add(self, branch: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.training and self.hidden_dropout > 0:
            # Sequence-parallel activations differ per tp rank, so their dropout masks must too.
            with self.ctx.tp_rng() if self.ctx.sequence_parallel else contextlib.nullcontext():
                branch = F.dropout(branch, self.hidden_dropout, training=True)
        return residual + branch

    def forward(self, x: torch.Tensor, rotary: Any = None, mask: torch.Tensor | None = None,
                cache: Any = None) -> torch.Tensor:
        """x [s(/tp), b, h] -> same shape; ``mask`` is a boolean [b, 1, 1|s, s] (True = attend)."""
        x = self.post_attention_layernorm(self._dropout_add(self.self_attention(x, None, mask, None), x))
        return self.post_mlp_layernorm(self._dropout_add(self.mlp(x), x))


class BertEmbedding(nn.Module):
    """Word + position (+ token-type) embeddings, scattered for sequence parallelism, then (post-LN) LayerNorm
    and dropout: ids [b, s] -> hidden [s(/tp), b, h]."""

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        c = ctx.config
        self.ctx = ctx
        std = c.init_method_std
        self.word_embeddings = VocabParallelEmbedding(
            c.padded_vocab_size, c.hidden_size, tp_group=ctx.tp_group, sequence_parallel=False,
            init_method=normal_init(ctx.seed, WORD_EMBEDDING, std), dtype=ctx.dtype, device=ctx.device)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size, dtype=ctx.dtype,
                                                device=ctx.device)
        normal_init(ctx.seed, "embedding.position_embeddings.weight", std)(self.position_embeddings.weight)
        mark_replicated(self.position_embeddings)
        self.tokentype_embeddings = None
        if c.type_vocab_size > 0:
            self.tokentype_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size, dtype=ctx.dtype,
                                                     device=ctx.device)
            normal_init(ctx.seed, "embedding.tokentype_embeddings.weight", std)(self.tokentype_embeddings.weight)
            mark_replicated(self.tokentype_embeddings)
        self.layernorm = None
        if not c.pre_layernorm:
            self.layernorm = LayerNorm(ctx, "embedding.layernorm")
            ctx.mark_partial_grads(self.layernorm, ctx.sequence_parallel)
        self.dropout = c.hidden_dropout

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
                tied: TiedGradient | None = None) -> torch.Tensor:
        """``tied`` (tp=1 only): share the word-embedding gradient with the tied MLM projection's."""
        s = input_ids.shape[1]
        if tied is not None:
            x = tied_embedding(input_ids.t(), self.word_embeddings.weight, tied)  # [s, b, h]
        else:
            x = self.word_embeddings(input_ids.t())  # [s, b, h], replicated over tp
        x = x + self.position_embeddings.weight[:s, None, :]
        if self.tokentype_embeddings is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            x = x + self.tokentype_embeddings(types.t())
        elif token_type_ids is not None:
            raise ValueError("token_type_ids given but model.type_vocab_size=0; set type_vocab_size or drop them")
        if self.ctx.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.ctx.tp_group)  # [s/tp, b, h]
        if self.layernorm is not None:
            x = self.layernorm(x)
        if self.training and self.dropout > 0:
            with self.ctx.tp_rng() if self.ctx.sequence_parallel else contextlib.nullcontext():
                x = F.dropout(x, self.dropout, training=True)
        return x


class BertLMHead(nn.Module):
    """The MLM transform (dense -> gelu -> LayerNorm) and the vocabulary-sharded output ``bias`` [V_pad/tp]."""

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        c = ctx.config
        self.activation = gelu_tanh if c.activation == "gelu_tanh" else F.gelu
        self.dense = replicated_linear(ctx, "lm_head.dense", c.hidden_size, c.hidden_size)
        self.layernorm = LayerNorm(ctx, "lm_head.layernorm")
        # Under sequence parallelism both act on this rank's sequence chunk: partial grads.
        ctx.mark_partial_grads(self.dense, ctx.sequence_parallel)
        ctx.mark_partial_grads(self.layernorm, ctx.sequence_parallel)
        self.bias = nn.Parameter(torch.zeros(c.padded_vocab_size // ctx.tp_size, device=ctx.device,
                                             dtype=ctx.dtype or torch.float32))
        set_tensor_parallel(self.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., h] (the [s(/tp), b, h] stream, or selected rows [n, h]) -> transformed, same shape."""
        return self.layernorm(self.activation(self.dense(x)))


class BertModel(PipelineStageModel):
    """BERT on mg-parallel layers (see module docstring).

    Args:
        config: the architecture (a :class:`BertConfig`).
        grid, pre_process, layer_range, sequence_parallel, seed, rng_tracker, recompute, dtype: as for
            :class:`~mg_models.stage.PipelineStageModel`.
        post_process: this chunk holds the heads (last pipeline stage): MLM and binary, or (``head="classification"``)
            pooler and classifier.

    Raises:
        ValueError: ``config`` is not a BertConfig, the layout does not fit it (names the field), or a bad
            layer_range.
    """

    def __init__(self, config: BertConfig, grid: ProcessGrid | None = None, *, pre_process: bool = True,
                 post_process: bool = True, layer_range: tuple[int, int] | None = None,
                 sequence_parallel: bool = False, seed: int = 1234, rng_tracker: Any = None,
                 recompute: Any = None, dtype: torch.dtype | None = None) -> None:
        if not isinstance(config, BertConfig):
            raise ValueError(f"BertModel needs a BertConfig, got {type(config).__name__}")
        super().__init__(config, grid, pre_process=pre_process, post_process=post_process, layer_range=layer_range,
                         sequence_parallel=sequence_parallel, seed=seed, rng_tracker=rng_tracker,
                         recompute=recompute, dtype=dtype)
        self.embedding = BertEmbedding(self.ctx) if pre_process else None
        spec = gpt_layer_spec(self.ctx) if config.pre_layernorm else ModuleSpec(BertLayer)
        self.encoder = TransformerBlock(self.ctx, "encoder", self.layer_range,
                                        post_process and config.pre_layernorm, spec)
        self.lm_head = self.output_layer = self.pooler = self.binary_head = self.classifier = None
        if post_process and not config.has_lm_head:
            self.pooler = replicated_linear(self.ctx, "pooler", config.hidden_size, config.hidden_size)
            self.classifier = replicated_linear(self.ctx, "classifier", config.hidden_size, config.num_labels)
        elif post_process:
            self.lm_head = BertLMHead(self.ctx)
            # The last stage of a pipeline owns a copy of the tied word embedding (Megatron's scheme).
            self.output_layer = ParallelLMHead(self.ctx, None if pre_process else WORD_EMBEDDING)
            if not pre_process:
                self.output_layer.weight.shared_embedding = True
            if config.add_binary_head:
                self.pooler = replicated_linear(self.ctx, "pooler", config.hidden_size, config.hidden_size)
                self.binary_head = replicated_linear(self.ctx, "binary_head", config.hidden_size, 2)
        if pre_process and config.has_lm_head:
            self.embedding.word_embeddings.weight.shared_embedding = True

    def forward(self, input_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, *, lm_labels: torch.Tensor | None = None,
                labels: torch.Tensor | None = None,
                gather_logits: bool | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Run this chunk.

        Args:
            input_ids: token ids [b, s] (required on the first stage).
            token_type_ids: segment ids [b, s]; None means all 0.
            attention_mask: [b, s], 1 for real tokens and 0 for padding (needed on every stage); None = no padding.
            lm_labels: MLM targets [b, s] (-100 = not masked). When given, the MLM output is the per-token
                loss [b, s] (fp32, 0 at ignored positions) instead of logits; only the labelled positions are
                projected onto the vocabulary.
            labels: classification head only: class ids [b] (or float targets, see
                :func:`~mg_models.heads.classification_loss`); the output is then the per-sample loss [b].
            gather_logits: return full MLM logits [b, s, vocab_size] instead of this rank's shard
                [b, s, V_pad/tp]; None uses ``self.gather_logits_default``.

        Returns:
            Non-last stages: hidden [s(/tp), b, h]. Last stage: ``(mlm_logits_or_loss, binary_logits)`` where
            binary_logits is [b, 2] (None without the binary head). Classification head: logits [b, num_labels]
            from the pooled [CLS], or the loss [b] with ``labels``.

        Raises:
            ValueError: an ``attention_mask`` or labels of the wrong shape, a sequence too long, or token types
                without a token-type embedding.
        """
        c = self.config
        b, s = self._batch_and_seq(input_ids)
        if s > c.max_position_embeddings:
            raise ValueError(f"sequence length {s} exceeds model.max_position_embeddings={c.max_position_embeddings}")
        tied = None
        if self.pre_process and self.lm_head is not None and self.ctx.tp_size == 1 and torch.is_grad_enabled():
            tied = TiedGradient()  # embedding and MLM projection share one weight here: one [V, h] gradient
        x = self.embedding(input_ids, token_type_ids, tied) if self.pre_process else self.input_tensor
        if attention_mask is not None:
            if attention_mask.shape != (b, s):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected [batch, seq] = "
                                 f"[{b}, {s}]")
            mask = attention_mask.bool()[:, None, None, :]  # [b, 1, 1, s]: padded keys are never attended
        else:
            # A non-None mask keeps attention bidirectional (SelfAttention is causal without one).
            mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=x.device)
        x = self.encoder(x, None, mask, None)
        if not self.post_process:
            return x
        if self.classifier is not None:
            return self._classify(x, labels)
        binary = None
        if self.binary_head is not None:
            binary = self.binary_head(self._pooled(x))  # [b, 2]
        weight = self.embedding.word_embeddings.weight if self.pre_process else None
        if lm_labels is not None:
            return self._masked_lm_loss(x, lm_labels, weight, tied), binary
        if tied is not None:
            logits = self.output_layer.tied_projection(self.lm_head(x), weight, self.lm_head.bias,
                                                       tied)  # [s, b, V_pad]
        else:
            logits = self.output_layer(self.lm_head(x), weight) + self.lm_head.bias  # [s, b, V_pad/tp]
        logits = logits.transpose(0, 1)  # [b, s, V_pad/tp]
        if gather_logits if gather_logits is not None else self.gather_logits_default:
            logits = gather_from_tp_region(logits.contiguous(), self.ctx.tp_group)[..., : c.vocab_size]
        return logits, binary

    def _pooled(self, x: torch.Tensor) -> torch.Tensor:
        """The tanh pooler on [CLS] (position 0): x [s(/tp), b, h] -> [b, h], replicated over tp."""
        return torch.tanh(self.pooler(full_sequence(self.ctx, x)[0]))

    def _classify(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Classification logits [b, num_labels] from the pooled [CLS], or the per-sample loss [b] with ``labels``."""
        pooled = self._pooled(x)
        c = self.config
        dropout = c.hidden_dropout if c.classifier_dropout is None else c.classifier_dropout
        if self.training and dropout > 0:
            pooled = F.dropout(pooled, dropout, training=True)  # replicated: the same mask on every tp rank
        logits = self.classifier(pooled)
        return classification_loss(logits, labels) if labels is not None else logits

    def _masked_lm_loss(self, x: torch.Tensor, lm_labels: torch.Tensor, weight: torch.Tensor | None,
                        tied: TiedGradient | None) -> torch.Tensor:
        """Per-token MLM loss [b, s] (fp32, 0 where ``lm_labels`` is -100) from the last hidden x [s(/tp), b, h].

        Only the labelled positions (about 15% in MLM pretraining) go through the vocabulary-sized
        projection and the cross entropy: the other rows would only be multiplied by a zero loss
        gradient, and that projection plus its weight gradient is the costliest part of the head.
        """
        b, s = lm_labels.shape
        if weight is None:
            weight = self.output_layer.weight
        labels = lm_labels.t()  # [s, b]
        rows = (labels != -100).reshape(-1).nonzero().squeeze(1)  # flat (s, b) indices of labelled tokens
        if self.ctx.sequence_parallel:
            # The head's transform holds partial grads per sequence chunk: apply it to the local chunk,
            # then gather the sequence (backward sums the vocab shards' input grads and re-splits them).
            h = gather_from_sequence_parallel_region(self.lm_head(x), self.ctx.tp_group)  # [s, b, h]
            h = h.reshape(s * b, -1).index_select(0, rows)  # [n, h]
        else:
            h = self.lm_head(x.reshape(s * b, -1).index_select(0, rows))  # [n, h]
            h = copy_to_tp_region(h, self.ctx.tp_group)
        if tied is not None:
            logits = self.output_layer.tied_projection(h, weight, self.lm_head.bias, tied)  # [n, V_pad]
        else:
            logits = self.output_layer.project(h, weight, self.lm_head.bias)  # [n, V_pad/tp]
        loss = vocab_parallel_cross_entropy(logits.float(), labels.reshape(-1).index_select(0, rows),
                                            tp_group=self.ctx.tp_group, vocab_size=self.config.vocab_size)
        full = loss.new_zeros(s * b).index_copy(0, rows, loss)  # [s * b]
        return full.view(s, b).t()  # [b, s]
