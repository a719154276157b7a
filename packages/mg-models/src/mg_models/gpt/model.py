"""GPTModel: a decoder-only language model (GPT-2 and Llama styles) on mg-parallel layers.

The same config builds the model at any tensor/sequence/pipeline layout:

* the word embedding is vocab-parallel, every linear is column/row-parallel and the head feeds the
  vocab-parallel cross entropy, so logits over the full vocabulary never exist on one rank;
* a pipeline stage is ``GPTModel(config, grid, pre_process=first, post_process=last,
  layer_range=(a, b))``; non-first stages take their input from :meth:`GPTModel.set_input_tensor`;
* parameter values derive from ``(seed, global parameter name)``, so any layout of the same seed
  holds slices of the same global tensors.

With tied embeddings and pp > 1 the last stage holds its own ``output_layer.weight``, initialised
exactly like ``embedding.word_embeddings.weight``; both carry ``shared_embedding=True`` so the
optimizer wrapper all-reduces their grads over the embedding group (Megatron's scheme).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mg_models.config import GPTConfig
from mg_models.heads import (
    WORD_EMBEDDING,
    ParallelLMHead,
    classification_loss,
    full_sequence,
    last_token_hidden,
    replicated_linear,
)
from mg_models.init import normal_init
from mg_models.layers import ContextParallelMask, RotaryEmbedding
from mg_models.spec import BuildContext, ModuleSpec
from mg_models.stage import PipelineStageModel
from mg_models.transformer import TransformerBlock
from mg_parallel.grid import ProcessGrid
from mg_parallel.tensor_parallel import (
    VocabParallelEmbedding,
    gather_from_tp_region,
    mark_replicated,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)

__all__ = ["GPTEmbedding", "GPTModel", "build_attention_mask", "context_parallel_inputs",
           "document_position_ids"]

class GPTEmbedding(nn.Module):
    """Word (+ learned position) embeddings and dropout: ids [b, s] -> hidden [s(/tp), b, h]."""

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        c = ctx.config
        self.ctx = ctx
        self.word_embeddings = VocabParallelEmbedding(
            c.padded_vocab_size, c.hidden_size, tp_group=ctx.tp_group, sequence_parallel=False,
            init_method=normal_init(ctx.seed, WORD_EMBEDDING, c.init_method_std), dtype=ctx.dtype, device=ctx.device)
        self.position_embeddings = None
        if c.position_embedding == "learned":
            self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size, dtype=ctx.dtype,
                                                    device=ctx.device)
            normal_init(ctx.seed, "embedding.position_embeddings.weight", c.init_method_std)(
                self.position_embeddings.weight)
            mark_replicated(self.position_embeddings)
        self.dropout = c.hidden_dropout

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids.t())  # [s, b, h], replicated over tp
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids.t())
        if self.ctx.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.ctx.tp_group)  # [s/tp, b, h]
            if self.training and self.dropout > 0:
                with self.ctx.tp_rng():
                    x = F.dropout(x, self.dropout, training=True)
        elif self.training and self.dropout > 0:
            x = F.dropout(x, self.dropout, training=True)
        return x


def build_attention_mask(batch: int, q_len: int, offset: int, attention_mask: torch.Tensor | None,
                         sliding_window: int | None, device: torch.device,
                         document_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """Boolean attention mask [b, 1, q_len, offset + q_len] (True = attend), or None when plain causal works.

    Queries are at positions ``offset .. offset+q_len-1``; ``attention_mask`` [b, offset+q_len]
    marks real (1) and padding (0) keys; ``document_ids`` [b, offset+q_len] (packed sequences) lets a
    query see only the keys of its own document. Every query may attend to itself, so padded rows
    never see an empty softmax (their outputs are ignored).

    Raises:
        ValueError: ``attention_mask`` or ``document_ids`` is not [batch, cached + new tokens].
    """
    k_len = offset + q_len
    needs_window = sliding_window is not None and k_len > sliding_window
    if attention_mask is None and document_ids is None and not needs_window and (offset == 0 or q_len == 1):
        return None
    q_pos = torch.arange(offset, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if needs_window:
        allowed = allowed & (q_pos - k_pos < sliding_window)
    allowed = allowed[None, None].expand(batch, 1, q_len, k_len)
    for name, per_key in (("attention_mask", attention_mask), ("document_ids", document_ids)):
        if per_key is not None and per_key.shape != (batch, k_len):
            raise ValueError(f"{name} has shape {tuple(per_key.shape)}, expected [batch, cached + new tokens] = "
                             f"[{batch}, {k_len}]")
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
    if document_ids is not None:
        same_document = document_ids[:, offset:, None] == document_ids[:, None, :]  # [b, q_len, k_len]
        allowed = allowed & same_document[:, None]
    return allowed | (k_pos == q_pos)[None, None]


def document_position_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 where the document id changes: document_ids [b, s] -> position_ids [b, s].

    Documents are contiguous runs of equal ids (as a packed sequence lays them out).
    """
    s = document_ids.shape[-1]
    index = torch.arange(s, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values  # start of each token's document
    return index - first


def context_parallel_inputs(ctx: BuildContext, b: int, s: int, position_ids: torch.Tensor | None,
                            document_ids: torch.Tensor | None, sliding_window: int | None, device: torch.device
                            ) -> tuple[torch.Tensor, ContextParallelMask]:
    """Position ids and the attention mask of this rank's ``s`` tokens when the sequence is split over the
    context-parallel group (``ctx.cp_size > 1``, load-balanced chunks of :func:`mg_parallel.context_parallel.split_for_cp`).

    Args:
        position_ids: ``[b, s]`` given positions (already this rank's part), or None for the tokens' global
            positions (restarting per document when ``document_ids`` are given).
        document_ids: ``[b, s]`` this rank's part of the packed documents' ids, or None.

    Returns:
        ``(position_ids [b, s], ContextParallelMask)``.
    """
    if position_ids is None:
        from mg_parallel.context_parallel import cp_position_ids, gather_from_cp, split_for_cp

        if document_ids is not None:  # positions restart per document, which spans ranks: the whole sequence's
            full = document_position_ids(gather_from_cp(document_ids, ctx.cp_group, seq_dim=1))
            position_ids = split_for_cp(full, ctx.cp_rank, ctx.cp_size, seq_dim=1)
        else:
            position_ids = cp_position_ids(s, ctx.cp_rank, ctx.cp_size, device).expand(b, s)
    return position_ids, ContextParallelMask(window=sliding_window, document_ids=document_ids)


def _check_context_parallel_call(attention_mask: torch.Tensor | None, inference_cache: Any, last_token_only: bool,
                                 output_mask: torch.Tensor | None, classification: bool) -> None:
    """Raise ValueError for what a forward cannot do with the sequence split over context-parallel ranks."""
    unsupported = [name for name, used in (("attention_mask (padding)", attention_mask is not None),
                                           ("inference_cache", inference_cache is not None),
                                           ("last_token_only", last_token_only),
                                           ("output_mask", output_mask is not None),
                                           ("the classification head", classification)) if used]
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)} is not supported with parallel.cp > 1 (the sequence is split "
                         f"over ranks); run it with parallel.cp: 1")


def _check_output_mask(mask: torch.Tensor, b: int, s: int, last_token_only: bool) -> None:
    """Raise ValueError unless ``mask`` is a bool [b, s] tensor (and last_token_only is off)."""
    if last_token_only:
        raise ValueError("pass output_mask or last_token_only, not both")
    if mask.dtype != torch.bool or mask.shape != (b, s):
        raise ValueError(f"output_mask is {mask.dtype} of shape {tuple(mask.shape)}, expected bool [batch, seq] = "
                         f"[{b}, {s}]")


class GPTModel(PipelineStageModel):
    """Decoder-only LM on mg-parallel layers (see module docstring).

    Args:
        config: the architecture.
        grid, pre_process, layer_range, sequence_parallel, seed, rng_tracker, dtype: as for
            :class:`~mg_models.stage.PipelineStageModel`.
        post_process: this chunk holds the final norm and the output head (last stage).
        recompute: an mg_parallel ``RecomputeConfig`` (full layers or core attention only), or None.
        layer_spec: override of the layer spec (default :func:`~mg_models.transformer.gpt_layer_spec`).

    Raises:
        ValueError: the layout does not fit the config (names the field), or a bad layer_range.
    """

    supports_context_parallel = True

    def __init__(self, config: GPTConfig, grid: ProcessGrid | None = None, *, pre_process: bool = True,
                 post_process: bool = True, layer_range: tuple[int, int] | None = None,
                 sequence_parallel: bool = False, seed: int = 1234, rng_tracker: Any = None,
                 recompute: Any = None, dtype: torch.dtype | None = None,
                 layer_spec: ModuleSpec | None = None) -> None:
        super().__init__(config, grid, pre_process=pre_process, post_process=post_process, layer_range=layer_range,
                         sequence_parallel=sequence_parallel, seed=seed, rng_tracker=rng_tracker,
                         recompute=recompute, dtype=dtype)
        grid = self.grid
        self.embedding = GPTEmbedding(self.ctx) if pre_process else None
        self.rotary = None
        if config.position_embedding == "rope":
            self.rotary = RotaryEmbedding(config.rotary_dim, config.rotary_base, device=grid.device,
                                          scaling=config.rotary_scaling,
                                          max_position_embeddings=config.max_position_embeddings)
        self.decoder = TransformerBlock(self.ctx, "decoder", self.layer_range, post_process, layer_spec, grid=grid)
        self.output_layer = self.score = None
        tied = config.tie_word_embeddings and config.has_lm_head
        if post_process and config.has_lm_head:
            init_name = None if tied and pre_process else (WORD_EMBEDDING if tied else "output_layer.weight")
            self.output_layer = ParallelLMHead(self.ctx, init_name)
            if tied and not pre_process:
                self.output_layer.weight.shared_embedding = True
        elif post_process:
            self.score = replicated_linear(self.ctx, "score", config.hidden_size, config.num_labels, bias=False)
        if tied and pre_process:
            self.embedding.word_embeddings.weight.shared_embedding = True

    def word_embeddings_weight(self) -> torch.Tensor:
        """The output head's weight shard [V_pad/tp, h] (the embedding's when tied on this stage)."""
        if self.output_layer is not None and hasattr(self.output_layer, "weight"):
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, *,
                document_ids: torch.Tensor | None = None, gather_logits: bool | None = None,
                inference_cache: Any = None, last_token_only: bool = False,
                output_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run this chunk (every pipeline stage takes the same position_ids, attention_mask and document_ids).

        Args:
            input_ids: token ids [b, s] (needed on the first stage; elsewhere used for shapes only).
            position_ids: [b, s]; default ``offset + arange(s)``, from ``attention_mask`` (left padding), or
                restarting at 0 per document of ``document_ids``.
            labels: LM head: target ids [b, s] (-100 = ignore); the last stage returns the per-token loss
                [b, s] (fp32; padded vocabulary masked out; with ``config.cross_entropy_chunk_tokens`` and no
                output_mask or last_token_only, projected and reduced that many tokens at a time).
                Classification head: class ids [b] (or float targets, see
                :func:`~mg_models.heads.classification_loss`); the last stage returns the per-sample loss [b].
            attention_mask: [b, offset + s] with 1 for real tokens and 0 for padding; None = no padding.
            document_ids: [b, offset + s] document of each token of packed sequences (contiguous runs of
                equal ids): a token attends only to earlier tokens of its own document.
            gather_logits: return full-vocabulary logits [b, s, vocab_size] (unpadded) instead of this
                rank's shard [b, s, V_pad/tp]; None uses ``self.gather_logits_default``.
            inference_cache: an :class:`~mg_models.generation.InferenceCache` for incremental decoding.
            last_token_only: compute logits for the last position only (s = 1 in the result).
            output_mask: bool [b, s]: compute logits (or the loss, with labels [n]) only where it is True; the
                result is [n, ...] over those n positions in row-major order (as ``tensor[output_mask]``).
                Without sequence parallelism only they are projected onto the vocabulary (scoring needs few).

        Returns:
            Non-last stages: hidden [s(/tp), b, h]. Last stage: loss [b, s] or logits (see above); with the
            classification head, logits [b, num_labels] of each sequence's last non-padding token, or loss [b].

        With ``grid.cp_size > 1`` every ``[b, s]`` argument is this rank's part of the sequence (chunks ``r`` and
        ``2cp-1-r`` of ``2cp``, :func:`mg_parallel.context_parallel.split_for_cp`), default positions are the
        tokens' global ones, and the per-token loss is of this rank's tokens (a mean over the whole sequence
        sums and counts over the cp group); padding masks, KV caches, picked outputs and the classification head
        are not supported then.

        Raises:
            ValueError: a mask, document ids, labels or output mask of the wrong shape, a sequence too long, or
                (context parallelism) an unsupported argument.
        """
        c = self.config
        b, s = self._batch_and_seq(input_ids)
        offset = inference_cache.offset if inference_cache is not None else 0
        cp = self.ctx.cp_size  # > 1: s is this rank's part of a sequence cp times longer
        if cp > 1:
            _check_context_parallel_call(attention_mask, inference_cache, last_token_only, output_mask,
                                         not c.has_lm_head)
        if offset + s * cp > c.max_position_embeddings and c.position_embedding == "learned":
            raise ValueError(f"sequence length {offset + s * cp} exceeds model.max_position_embeddings="
                             f"{c.max_position_embeddings}")
        device = self.grid.device
        if cp > 1:
            position_ids, mask = context_parallel_inputs(self.ctx, b, s, position_ids, document_ids,
                                                         c.sliding_window, device)
        elif position_ids is None:
            if document_ids is not None:
                position_ids = document_position_ids(document_ids)[:, offset:offset + s]
            elif attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, offset:offset + s]
            else:
                position_ids = torch.arange(offset, offset + s, device=device).expand(b, s)
        x = self.embedding(input_ids, position_ids) if self.pre_process else self.input_tensor
        rotary = self.rotary(position_ids) if self.rotary is not None else None
        if cp == 1:
            mask = build_attention_mask(b, s, offset, attention_mask, c.sliding_window, device, document_ids)
        x = self.decoder(x, rotary, mask, inference_cache)
        if inference_cache is not None:
            inference_cache.advance(s, last_stage=self.post_process)
        if not self.post_process:
            return x
        if self.score is not None:
            mask = attention_mask[:, offset:] if attention_mask is not None else None
            logits = self.score(last_token_hidden(full_sequence(self.ctx, x), mask))  # [b, num_labels]
            return classification_loss(logits, labels) if labels is not None else logits
        weight = self.embedding.word_embeddings.weight if not hasattr(self.output_layer, "weight") else None
        picked = output_mask is not None
        if labels is not None and c.cross_entropy_chunk_tokens is not None and not picked and not last_token_only:
            return self.output_layer.chunked_loss(x, labels.t(), weight).t()  # [b, s]
        if picked:
            _check_output_mask(output_mask, b, s, last_token_only)
        if last_token_only and not self.ctx.sequence_parallel:
            x = x[-1:]
        elif picked and not self.ctx.sequence_parallel:
            x = x.transpose(0, 1)[output_mask]  # [n, h]: the vocabulary projection dominates short scoring
        logits = self.output_layer(x, weight)  # [s, b, V_pad/tp] ([n, V_pad/tp] picked)
        if last_token_only:
            logits = logits[-1:]
        elif picked and self.ctx.sequence_parallel:
            logits = logits.transpose(0, 1)[output_mask]  # [n, V_pad/tp]
        if labels is not None:
            loss = vocab_parallel_cross_entropy(logits.float(), labels if picked else labels.t(),
                                                tp_group=self.ctx.tp_group, vocab_size=c.vocab_size)
            return loss if picked else loss.t()  # [n] or [b, s]
        if not picked:
            logits = logits.transpose(0, 1)  # [b, s, V_pad/tp]
        if gather_logits is None:
            gather_logits = self.gather_logits_default
        if gather_logits:
            logits = gather_from_tp_region(logits.contiguous(), self.ctx.tp_group)[..., : c.vocab_size]
        return logits
