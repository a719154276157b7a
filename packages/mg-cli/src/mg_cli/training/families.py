"""What differs between the model families of ``mg train`` (gpt, bert, t5), in one place.

* the architecture: preset + explicit ``model.*`` keys -> ``GPTConfig`` / ``BertConfig`` / ``T5Config``;
* the special tokens a family's samples need from the tokenizer (BERT: ``<cls> <sep> <mask>`` and
  padding; T5: padding, end of sequence and the ``<extra_id_k>`` sentinels);
* the loss of one micro-batch (``forward_step`` for the pipeline schedules).

Losses, all means over one micro-batch (the schedules then average micro-batches, and data-parallel
replicas, so the logged loss does not depend on the layout):

* gpt: mean token loss over ``loss_mask``;
* bert: masked-LM mean over the masked tokens + cross entropy of the binary (sentence-order or
  next-sentence) head over the samples; ``lm_loss`` and ``sop_loss`` / ``nsp_loss`` are logged too;
* t5: mean decoder token loss over the targets (``loss_mask``); logged as ``loss`` and ``lm_loss``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mg_cli.config import ConfigError, RunConfig
from mg_cli.training.setup import TrainingError

if TYPE_CHECKING:  # torch is imported where tensors are made
    import torch

FAMILIES = ("gpt", "bert", "t5")

BERT_SYMBOLS = "<pad>,<cls>,<sep>,<mask>"


def _presets(family: str) -> dict[str, dict[str, Any]]:
    if family == "bert":
        from mg_models.bert import BERT_PRESETS

        return BERT_PRESETS
    if family == "t5":
        from mg_models.t5 import T5_PRESETS

        return T5_PRESETS
    from mg_models.gpt.presets import PRESETS

    return PRESETS


def _preset_fields(config: RunConfig) -> dict[str, Any]:
    m = config.model
    if m.preset is None:
        return {}
    presets = _presets(m.type)
    if m.preset not in presets:
        if m.type == "gpt":
            raise TrainingError(f"model.preset={m.preset!r} is unknown; choose one of {sorted(presets)}")
        raise TrainingError(f"model.preset={m.preset!r} is not a {m.type.upper()} preset (model.type={m.type}); "
                            f"choose one of {sorted(presets)}")
    return dict(presets[m.preset])


def model_config(config: RunConfig, vocab_size: int, pretrained: Any = None, num_labels: int | None = None) -> Any:
    """The architecture of ``model.type``: the preset (if any), the ``model.*`` keys given (the fields of the
    family's config class, same names), and what the run fills in (the tokenizer's vocabulary, positions for
    ``model.seq_length``, BERT's binary head from ``data.sentence_task``). A ``GPTConfig``, ``BertConfig`` or
    ``T5Config`` (or whatever class the schema names for the family).

    ``model.dropout`` (T5's one dropout) sets both ``attention_dropout`` and ``hidden_dropout`` of GPT and BERT
    unless they are given. With ``pretrained`` (``checkpoint.init_from``) its architecture takes the preset's
    place. ``data.format: classification`` selects the classification head with the data's ``num_labels``.

    Raises:
        TrainingError: unknown preset, missing shape without a preset, a key the family does not use, or
            whatever the config class rejects (in its own words, naming the key).
    """
    m = config.model
    try:
        cls = config.family_class("model", allow=("dropout",))
    except ConfigError as e:
        raise TrainingError(str(e)) from None
    if m.type != "t5" and m.decoder_seq_length is not None:
        raise TrainingError(f"model.decoder_seq_length is only used by model.type=t5; leave it unset for {m.type}")
    if m.type == "gpt" and m.activation in ("relu", "gated-gelu"):
        raise TrainingError(f"model.activation={m.activation} is a T5 activation; use gelu, gelu_tanh or swiglu for gpt")
    if pretrained is not None:
        from mg_cli.training.pretrained import architecture

        if m.preset is not None:
            raise TrainingError("model.preset and checkpoint.init_from both give the architecture; leave "
                                "model.preset unset (model.* keys still override the pretrained model's)")
        base = architecture(pretrained, m.type)
    else:
        base = _preset_fields(config)
    fields = {**base, **config.values_for(cls)}
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if k not in fields]
    if missing:
        raise TrainingError(f"model.{missing[0]} is not set and model.preset is not given; set a preset or the shape")
    fields["vocab_size"] = vocab_size
    if m.type != "t5":
        if m.dropout is not None:
            fields.setdefault("attention_dropout", m.dropout)
            fields.setdefault("hidden_dropout", m.dropout)
        fields["max_position_embeddings"] = max(int(fields.get("max_position_embeddings", 0)), m.seq_length)
    if m.type == "bert":
        fields["add_binary_head"] = config.data.sentence_task != "none"
    if config.data.format == "classification":
        if m.head not in (None, "classification") or m.num_labels not in (None, num_labels):
            raise TrainingError(f"data.format=classification trains a classification head over the data's "
                                f"{num_labels} labels; leave model.head and model.num_labels unset")
        fields.update(head="classification", num_labels=num_labels)
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise TrainingError(str(e)) from None


def check_t5_layout(config: RunConfig) -> None:
    """What T5 training does not support, as one-line errors naming the key."""
    p = config.parallel
    if p.vpp > 1:
        raise TrainingError(f"parallel.vpp={p.vpp}: the interleaved pipeline schedule is not supported for "
                            f"model.type=t5; use parallel.vpp=1 (parallel.pp alone cuts the encoder and decoder "
                            f"layers into stages)")
    if p.pp > 1 and p.fsdp:
        raise TrainingError(f"parallel.fsdp with parallel.pp={p.pp} is not supported for model.type=t5; use the "
                            f"distributed optimizer (parallel.distributed_optimizer=true) with the pipeline")
    if p.sequence_parallel:
        raise TrainingError("parallel.sequence_parallel is not supported for model.type=t5; set it to false")
    if p.recompute_granularity is not None:
        raise TrainingError(f"parallel.recompute_granularity={p.recompute_granularity} is not supported for "
                            f"model.type=t5; leave it unset")


# ----------------------------------------------------------------------------------------------- tokens


def _piece_id(tokenizer: Any, pieces: tuple[str, ...]) -> int | None:
    """Id of the first of ``pieces`` the tokenizer holds as one token (SentencePiece or Hugging Face)."""
    sp = getattr(tokenizer, "sp", None)
    tok = getattr(tokenizer, "tok", None)
    for piece in pieces:
        if sp is not None:
            i = sp.piece_to_id(piece)
            if i != sp.unk_id() and sp.id_to_piece(i) == piece:
                return int(i)
        elif tok is not None:
            i = tok.token_to_id(piece)
            if i is not None:
                return int(i)
    return None


def pad_id(tokenizer: Any) -> int | None:
    """The tokenizer's padding id: its own pad id, else a ``<pad>``/``[PAD]`` token (None without one).

    T5 decoder inputs start with it, so ``mg generate`` and ``mg convert`` use it as the decoder
    start id of checkpoints ``mg train`` wrote (Hugging Face's T5 does the same with its pad id 0).
    """
    return tokenizer.pad if tokenizer.pad is not None else _piece_id(tokenizer, ("<pad>", "[PAD]"))


@dataclass
class SpecialTokens:
    """Ids of the special tokens a family's samples use (None where the family needs none)."""

    pad: int | None = None
    eos: int | None = None
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None
    sentinels: list[int] | None = None


def _missing(model_type: str, what: str, tokenizer_path: str, fix: str) -> TrainingError:
    return TrainingError(f"data.tokenizer_model: {tokenizer_path} has no {what}, which model.type={model_type} needs; "
                         f"train a tokenizer with it: `mg tokenizer train --input ... --output-prefix ... {fix}` "
                         f"(then rerun `mg preprocess` with it)")


def t5_lengths(encoder_length: int) -> tuple[int, int]:
    """``(decoder targets length, noise spans per sample)`` for an encoder length (T5 paper formula, mg-data).

    Raises:
        TrainingError: ``encoder_length`` too short for span corruption.
    """
    from mg_data import T5DatasetConfig

    try:
        probe = T5DatasetConfig(encoder_seq_length=encoder_length, sentinel_ids=range(encoder_length), eos_id=0,
                                pad_id=0)
    except ValueError as e:
        raise TrainingError(f"model.seq_length={encoder_length}: {e}") from None
    return probe.decoder_length, probe.num_noise_spans


def special_tokens(config: RunConfig, tokenizer: Any) -> SpecialTokens:
    """The special-token ids ``config.model.type`` needs, looked up in the tokenizer.

    Raises:
        TrainingError: a needed token is missing; the message gives the ``mg tokenizer train`` options
            that add it.
    """
    family, path = config.model.type, str(config.data.tokenizer_model)
    pad = pad_id(tokenizer)
    if family == "gpt":
        return SpecialTokens(eos=tokenizer.eod, pad=pad)
    if family == "bert":
        fix = f"--user-defined-symbols '{BERT_SYMBOLS}'"
        ids = {"padding token <pad>": pad,
               "<cls> token": _piece_id(tokenizer, ("<cls>", "[CLS]")),
               "<sep> token": _piece_id(tokenizer, ("<sep>", "[SEP]")),
               "<mask> token": tokenizer.mask if tokenizer.mask is not None else _piece_id(tokenizer, ("<mask>",
                                                                                                       "[MASK]"))}
        for what, value in ids.items():
            if value is None:
                raise _missing(family, what, path, fix)
        pad, cls, sep, mask = ids.values()
        return SpecialTokens(pad=pad, cls=cls, sep=sep, mask=mask)
    seq2seq = config.data.format == "seq2seq"  # input -> target pairs: no span corruption, no sentinels
    spans = 0 if seq2seq else t5_lengths(config.model.seq_length)[1]
    fix = "--user-defined-symbols '<pad>'" + ("" if seq2seq else f" --extra-ids {max(100, spans)}")
    if pad is None:
        raise _missing(family, "padding token <pad>", path, fix)
    if tokenizer.eod is None:
        raise _missing(family, "end-of-sequence token </s>", path, fix)
    sentinels = []
    for k in range(spans):
        i = _piece_id(tokenizer, (f"<extra_id_{k}>",))
        if i is None:
            raise _missing(family, f"sentinel token <extra_id_{k}> (model.seq_length={config.model.seq_length} "
                           f"needs {spans} sentinels, <extra_id_0>..<extra_id_{spans - 1}>)", path, fix)
        sentinels.append(i)
    return SpecialTokens(pad=pad, eos=tokenizer.eod, sentinels=sentinels)


# ------------------------------------------------------------------------------------------------- loss


def _masked_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.float()
    return (per_token.float() * mask).sum() / mask.sum().clamp(min=1)


def context_parallel_masked_mean(per_token: torch.Tensor, mask: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """This context-parallel rank's share of the masked mean over whole sequences, times cp (a collective over
    ``cp_group``).

    ``per_token`` and ``mask`` [b, s/cp] are this rank's tokens. The mask is counted over the whole sequence,
    so the cp ranks' values sum to cp times the mean one process computes; the schedules' loss average and the
    gradient average over dp x cp then give exactly its loss and gradients.
    """
    import torch.distributed as dist

    mask = mask.float()
    count = mask.sum()
    dist.all_reduce(count, group=cp_group)
    return (per_token.float() * mask).sum() * dist.get_world_size(cp_group) / count.clamp(min=1)


def _token_mean(per_token: torch.Tensor, mask: torch.Tensor, cp_group: Any) -> torch.Tensor:
    if cp_group is None:
        return _masked_mean(per_token, mask)
    return context_parallel_masked_mean(per_token, mask, cp_group)


def _gpt_step(batch: dict[str, torch.Tensor], chunk: Any, *, cp_group: Any = None) -> tuple[Any, Any]:
    output = chunk(batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"])
    return output, lambda per_token: (_token_mean(per_token, batch["loss_mask"], cp_group), {})


def _sft_step(batch: dict[str, torch.Tensor], chunk: Any, *, cp_group: Any = None) -> tuple[Any, Any]:
    output = chunk(batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"],
                   document_ids=batch["document_ids"])
    return output, lambda per_token: (_token_mean(per_token, batch["loss_mask"], cp_group), {})


def _gpt_classification_step(batch: dict[str, torch.Tensor], chunk: Any) -> tuple[Any, Any]:
    # Per-sample losses of the label read at each sequence's last real token: their mean.
    output = chunk(batch["tokens"], labels=batch["label"], attention_mask=batch["attention_mask"])
    return output, lambda per_sample: (per_sample.float().mean(), {})


def _bert_classification_step(batch: dict[str, torch.Tensor], chunk: Any) -> tuple[Any, Any]:
    output = chunk(batch["text"], batch["types"], batch["padding_mask"], labels=batch["label"])
    return output, lambda per_sample: (per_sample.float().mean(), {})


def _bert_step(batch: dict[str, torch.Tensor], chunk: Any, *, sentence_task: str) -> tuple[Any, Any]:
    import torch.nn.functional as F

    # Every stage gets the padding mask (attention); the first the ids, the last the targets.
    output = chunk(batch["text"], batch["types"], batch["padding_mask"], lm_labels=batch["labels"])

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, dict[str, Any]]:
        lm, binary = out
        lm_loss = _masked_mean(lm, batch["loss_mask"])
        if binary is None:
            return lm_loss, {"lm_loss": lm_loss.detach()}
        binary_loss = F.cross_entropy(binary.float(), batch["is_random"])
        return lm_loss + binary_loss, {"lm_loss": lm_loss.detach(), f"{sentence_task}_loss": binary_loss.detach()}
    return output, loss_fn


def _t5_step(batch: dict[str, torch.Tensor], chunk: Any) -> tuple[Any, Any]:
    # Decoder padding follows every target, so the causal mask alone keeps real positions off it. Every stage gets
    # the ids (their lengths) and the source mask; the last stage returns (per-token loss, encoder output).
    output = chunk(batch["text_enc"], batch["text_dec"], batch["enc_mask"], labels=batch["labels"])

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        loss = _masked_mean(out[0], batch["loss_mask"])
        return loss, {"lm_loss": loss.detach()}
    return output, loss_fn


def forward_step_for(family: str, sentence_task: str = "sop", data_format: str = "pretrain", *,
                     cp_group: Any = None) -> Callable[[dict[str, Any], Any], tuple[Any, Any]]:
    """``forward_step(batch, chunk) -> (output, loss_fn)`` of ``family`` and ``data_format`` for the pipeline
    schedules.

    ``loss_fn(output) -> (loss, logs)``: the micro-batch loss (see the module docstring) and the detached parts
    (``lm_loss``, ``sop_loss``/``nsp_loss``) to log. ``sft``: packed conversations, every stage getting their
    ``document_ids`` (no attention across conversations) and ``position_ids`` (restarting per conversation);
    ``classification``: the mean of the per-sample losses of the head; t5's ``seq2seq`` samples are shaped like
    its pretraining samples. ``cp_group`` (gpt, a context-parallel group of more than one rank): the batch holds
    this rank's part of every sequence and the loss is :func:`context_parallel_masked_mean`.
    """
    if cp_group is not None and family == "gpt" and data_format in ("pretrain", "sft"):
        return functools.partial(_sft_step if data_format == "sft" else _gpt_step, cp_group=cp_group)
    if data_format == "sft":
        return _sft_step
    if data_format == "classification":
        return {"gpt": _gpt_classification_step, "bert": _bert_classification_step}[family]
    if family == "bert":
        return functools.partial(_bert_step, sentence_task=sentence_task)
    return {"gpt": _gpt_step, "t5": _t5_step}[family]


def decoder_length(ds_config: Any) -> int:
    """A T5 sample's decoder length: the padded ``decoder_seq_length`` or, unset, the span-corruption target's."""
    return ds_config.decoder_seq_length or ds_config.decoder_length


def step_flops_per_token(family: str, model_cfg: Any, ds_config: Any, seq_length: int, data_format: str = "pretrain",
                         *, recompute: bool) -> float:
    """Model FLOPs of one training step per token counted in ``tokens_per_s`` (matmuls, forward + backward).

    gpt: per token of the sequence. t5: per encoder token, the decoder's share included (its length
    from the T5 dataset config). bert: the MLM head runs on the masked positions only, at most
    ``masked_lm_prob`` of the sample's tokens (from the BERT dataset config).
    """
    from mg_models import flops_per_token

    if family == "t5":
        return flops_per_token(model_cfg, seq_length, recompute=recompute,
                               decoder_seq_length=decoder_length(ds_config))
    if family == "bert" and data_format == "pretrain":
        masked = max(1, round(ds_config.masked_lm_prob * ds_config.max_num_tokens)) / seq_length
        return flops_per_token(model_cfg, seq_length, recompute=recompute, masked_lm_fraction=masked)
    return flops_per_token(model_cfg, seq_length, recompute=recompute)


def logged_losses(family: str, sentence_task: str, data_format: str = "pretrain") -> tuple[str, ...]:
    """Keys of a micro-batch's logs averaged and logged besides ``loss``."""
    if data_format in ("sft", "classification"):
        return ()
    if family == "bert":
        return ("lm_loss",) if sentence_task == "none" else ("lm_loss", f"{sentence_task}_loss")
    if family == "t5":
        return ("lm_loss",)
    return ()
