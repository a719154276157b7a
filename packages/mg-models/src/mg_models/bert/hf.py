"""Hugging Face ``BertForPreTraining`` / ``BertForMaskedLM`` / ``BertForSequenceClassification`` <-> mg BERT: config
and tensor mapping.

Hugging Face keeps separate query/key/value projections; mg fuses them per head as
``[q_h, k_h, v_h]`` (the grouped layout of :mod:`mg_models.layers`). The MLM decoder weight is the
word embedding (tied), and ``cls.predictions.decoder.bias`` is the same tensor as
``cls.predictions.bias``, so only the latter is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mg_models.bert import BertConfig
from mg_models.hf.common import (
    concat,
    head_from_hf,
    head_to_hf,
    load_safetensors_dir,
    pad_vocab,
    read_config_json,
    unpad_vocab,
    write_hf_files,
)
from mg_models.hf.groups import TensorGroup, mapped, rename, to_hf_state, to_mg_state

__all__ = ["config_from_hf", "config_to_hf", "is_ignored", "read_hf_bert", "state_from_hf",
           "state_to_hf", "tensor_groups", "write_hf_bert"]

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
# Buffers and tied aliases Hugging Face may save that carry no information of their own.
_IGNORED = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids", "cls.predictions.decoder.weight",
            "cls.predictions.decoder.bias")


def config_from_hf(hf: dict[str, Any], where: str = "config.json") -> BertConfig:
    """BertConfig from a BERT ``config.json`` dict.

    Raises:
        ValueError: a feature mg does not implement (names the config.json key).
    """
    missing = [k for k in _REQUIRED if k not in hf]
    if missing:
        raise ValueError(f"{where}: model_type='bert' config lacks required keys {missing}; save it with "
                         f"BertConfig.save_pretrained")
    act = hf.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"{where}: hidden_act={act!r} is not supported; use one of {sorted(_ACTIVATIONS)}")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{where}: position_embedding_type={hf['position_embedding_type']!r}; only 'absolute' is "
                         f"supported")
    archs = hf.get("architectures") or ["BertForPreTraining"]
    head = head_from_hf(hf, where)
    return BertConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], max_position_embeddings=hf.get("max_position_embeddings", 512),
        type_vocab_size=hf.get("type_vocab_size", 2), norm_eps=hf.get("layer_norm_eps", 1e-12),
        activation=_ACTIVATIONS[act], hidden_dropout=hf.get("hidden_dropout_prob", 0.0),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.0),
        init_method_std=hf.get("initializer_range", 0.02),
        add_binary_head=head["head"] == "lm" and "BertForMaskedLM" not in archs,
        classifier_dropout=hf.get("classifier_dropout") if head["head"] == "classification" else None, **head,
    )


def config_to_hf(c: BertConfig) -> dict[str, Any]:
    """A BERT ``config.json`` dict for ``c`` (``BertForPreTraining`` with the binary head, else ``BertForMaskedLM``;
    ``BertForSequenceClassification`` for the classification head).

    Raises:
        ValueError: ``c`` uses a feature Hugging Face BERT cannot express (names the field).
    """
    if c.pre_layernorm or not c.add_bias_linear or c.query_groups != c.num_attention_heads:
        raise ValueError("Hugging Face BERT needs post-LN (model.pre_layernorm=False), biases and multi-head attention")
    if c.head_dim * c.num_attention_heads != c.hidden_size:
        raise ValueError("Hugging Face BERT needs model.kv_channels * num_attention_heads == hidden_size")
    inverse = {v: k for k, v in _ACTIVATIONS.items() if k != "gelu_pytorch_tanh"}
    out = {
        **head_to_hf(c, "Bert", "BertForPreTraining" if c.add_binary_head else "BertForMaskedLM"), "model_type": "bert",
        "num_hidden_layers": c.num_layers, "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_attention_heads, "intermediate_size": c.ffn_size, "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings, "type_vocab_size": max(c.type_vocab_size, 1),
        "layer_norm_eps": c.norm_eps, "hidden_act": inverse[c.activation], "hidden_dropout_prob": c.hidden_dropout,
        "attention_probs_dropout_prob": c.attention_dropout, "initializer_range": c.init_method_std,
        "position_embedding_type": "absolute", "tie_word_embeddings": True,
    }
    if not c.has_lm_head:
        out["classifier_dropout"] = c.classifier_dropout
    return out


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """[h*d, ...] x3 -> grouped [heads * (q_h, k_h, v_h), ...]."""
    parts = [t.reshape(heads, 1, -1, *t.shape[1:]) for t in (q, k, v)]  # [heads, 1, d, ...]
    return concat(parts, dim=1).reshape(-1, *q.shape[1:])


def _split_qkv(w: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`_fuse_qkv`."""
    grouped = w.reshape(heads, 3, -1, *w.shape[1:])
    return tuple(grouped[:, i].reshape(-1, *w.shape[1:]).contiguous() for i in range(3))


def _layer_pairs(i: int) -> list[tuple[str, str]]:
    """(mg name, HF name) of the non-QKV tensors of layer i."""
    mg, hf = f"encoder.layers.{i}", f"bert.encoder.layer.{i}"
    pairs = []
    for mg_mod, hf_mod in (("self_attention.linear_proj", "attention.output.dense"),
                           ("post_attention_layernorm", "attention.output.LayerNorm"),
                           ("mlp.linear_fc1", "intermediate.dense"), ("mlp.linear_fc2", "output.dense"),
                           ("post_mlp_layernorm", "output.LayerNorm")):
        pairs += [(f"{mg}.{mg_mod}.{p}", f"{hf}.{hf_mod}.{p}") for p in ("weight", "bias")]
    return pairs


def _head_pairs(c: BertConfig) -> list[tuple[str, str]]:
    pairs = [("embedding.position_embeddings.weight", "bert.embeddings.position_embeddings.weight")]
    if c.has_lm_head:
        pairs += [("lm_head.dense.weight", "cls.predictions.transform.dense.weight"),
                  ("lm_head.dense.bias", "cls.predictions.transform.dense.bias"),
                  ("lm_head.layernorm.weight", "cls.predictions.transform.LayerNorm.weight"),
                  ("lm_head.layernorm.bias", "cls.predictions.transform.LayerNorm.bias")]
    pairs += [(f"embedding.layernorm.{p}", f"bert.embeddings.LayerNorm.{p}") for p in ("weight", "bias")]
    if c.type_vocab_size > 0:
        pairs.append(("embedding.tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight"))
    if c.add_binary_head or not c.has_lm_head:
        pairs += [(f"pooler.{p}", f"bert.pooler.dense.{p}") for p in ("weight", "bias")]
    if not c.has_lm_head:
        pairs += [(f"classifier.{p}", f"classifier.{p}") for p in ("weight", "bias")]
    elif c.add_binary_head:
        pairs += [(f"binary_head.{p}", f"cls.seq_relationship.{p}") for p in ("weight", "bias")]
    return pairs


def tensor_groups(c: BertConfig) -> list[TensorGroup]:
    """The model as per-tensor conversions: renames, vocabulary padding, one q/k/v fusion group per layer and parameter."""
    heads = c.num_attention_heads
    groups = [mapped("bert.embeddings.word_embeddings.weight", "embedding.word_embeddings.weight",
                     lambda w: pad_vocab(w, c), lambda w: unpad_vocab(w, c))]
    if c.has_lm_head:
        groups.append(mapped("cls.predictions.bias", "lm_head.bias", lambda b: pad_vocab(b[:, None], c)[:, 0],
                             lambda b: b[: c.vocab_size].contiguous()))
    groups += [rename(h, m) for m, h in _head_pairs(c)]
    for i in range(c.num_layers):
        attn = f"bert.encoder.layer.{i}.attention.self"
        for p in ("weight", "bias"):
            groups.append(TensorGroup(
                tuple(f"{attn}.{n}.{p}" for n in ("query", "key", "value")),
                (f"encoder.layers.{i}.self_attention.linear_qkv.{p}",),
                lambda q, k, v: (_fuse_qkv(q, k, v, heads),), lambda w: _split_qkv(w, heads)))
        groups += [rename(h, m) for m, h in _layer_pairs(i)]
    return groups


def state_from_hf(hf: dict[str, torch.Tensor], c: BertConfig) -> dict[str, torch.Tensor]:
    """Unsharded mg BERT state dict from a Hugging Face one.

    Raises:
        ValueError: a tensor is missing, or the checkpoint holds tensors mg does not know.
    """
    hf = {k: v for k, v in hf.items() if k not in _IGNORED}
    groups = tensor_groups(c)
    needed = [n for g in groups for n in g.hf]
    for name in needed:
        if name not in hf:
            raise ValueError(f"checkpoint is missing tensor {name!r} required by its config.json")
    extra = sorted(set(hf) - set(needed))
    if extra:
        raise ValueError(f"checkpoint holds tensors mg's BERT does not know: {extra[:5]}")
    return to_mg_state(groups, hf)


def is_ignored(name: str) -> bool:
    """True for Hugging Face tensors that carry nothing of their own (buffers, tied aliases)."""
    return name in _IGNORED


def state_to_hf(mg: dict[str, torch.Tensor], c: BertConfig) -> dict[str, torch.Tensor]:
    """Hugging Face BERT state dict (exact names, no tied aliases) from an unsharded mg one."""
    return to_hf_state(tensor_groups(c), mg)


def read_hf_bert(path: str | Path) -> tuple[BertConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face BERT directory -> (BertConfig, unsharded mg state dict).

    Raises:
        FileNotFoundError: no config.json or safetensors weights.
        ValueError: not a BERT, unsupported feature or mismatched tensors.
    """
    path = Path(path)
    cfg_file, hf_config = read_config_json(path, "bert")
    config = config_from_hf(hf_config, str(cfg_file))  # config errors first, before reading weights
    hf_state = load_safetensors_dir(path)
    if config.add_binary_head and "bert.pooler.dense.weight" not in hf_state:
        config = config_from_hf({**hf_config, "architectures": ["BertForMaskedLM"]}, str(cfg_file))
    return config, state_from_hf(hf_state, config)


def write_hf_bert(path: str | Path, mg_state: dict[str, torch.Tensor], config: BertConfig) -> Path:
    """Write ``config.json`` + ``model.safetensors`` loadable by ``BertForPreTraining`` / ``BertForMaskedLM`` /
    ``BertForSequenceClassification`` (as ``config.architectures`` says)."""
    return write_hf_files(path, state_to_hf(mg_state, config), config_to_hf(config))
