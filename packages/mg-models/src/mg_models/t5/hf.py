"""Hugging Face ``T5ForConditionalGeneration`` <-> mg T5: config and tensor mapping.

Hugging Face stores the shared embedding as ``shared.weight`` (``encoder.embed_tokens`` /
``decoder.embed_tokens`` are aliases) and the relative bias table in the first block of each stack.
Whether the head is tied is read from the weights (a separate ``lm_head.weight`` = untied), and
whether the decoder output is scaled from ``scale_decoder_outputs`` (newer files) or
``tie_word_embeddings`` (older files, where v1.1 sets it to false).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mg_models.hf.common import load_safetensors_dir, pad_vocab, read_config_json, unpad_vocab, write_hf_files
from mg_models.hf.groups import TensorGroup, mapped, rename, to_hf_state, to_mg_state
from mg_models.t5 import T5Config

__all__ = ["config_from_hf", "config_to_hf", "is_ignored", "read_hf_t5", "state_from_hf", "state_to_hf",
           "tensor_groups", "write_hf_t5"]

_ACTIVATIONS = {"relu": "relu", "gated-gelu": "gated-gelu"}
_ALIASES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def config_from_hf(hf: dict[str, Any], where: str = "config.json", *, has_lm_head: bool | None = None) -> T5Config:
    """T5Config from a T5 ``config.json`` dict; ``has_lm_head`` (the weights hold ``lm_head.weight``) decides tying.

    Raises:
        ValueError: a feature mg does not implement (names the config.json key).
    """
    missing = [k for k in ("num_layers", "d_model", "num_heads", "d_kv", "d_ff", "vocab_size") if k not in hf]
    if missing:
        raise ValueError(f"{where}: model_type='t5' config lacks required keys {missing}; save it with "
                         f"T5Config.save_pretrained")
    act = hf.get("feed_forward_proj", "relu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"{where}: feed_forward_proj={act!r} is not supported; use 'relu' or 'gated-gelu'")
    tie_flag = hf.get("tie_word_embeddings", True) is not False
    scale = hf.get("scale_decoder_outputs", tie_flag)
    tied = tie_flag if has_lm_head is None else not has_lm_head
    return T5Config(
        num_layers=hf["num_layers"], num_decoder_layers=hf.get("num_decoder_layers"), hidden_size=hf["d_model"],
        num_attention_heads=hf["num_heads"], kv_channels=hf["d_kv"], ffn_hidden_size=hf["d_ff"],
        vocab_size=hf["vocab_size"], activation=_ACTIVATIONS[act],
        relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), dropout=hf.get("dropout_rate", 0.0),
        tie_word_embeddings=tied, scale_decoder_output=bool(scale), init_factor=hf.get("initializer_factor", 1.0),
    )


def config_to_hf(c: T5Config) -> dict[str, Any]:
    """A T5 ``config.json`` dict for ``c`` (both the old ``tie_word_embeddings`` and new ``scale_decoder_outputs``)."""
    return {
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "num_layers": c.num_layers,
        "num_decoder_layers": c.decoder_layers, "d_model": c.hidden_size, "num_heads": c.num_attention_heads,
        "d_kv": c.kv_channels, "d_ff": c.ffn_hidden_size, "vocab_size": c.vocab_size,
        "feed_forward_proj": c.activation, "relative_attention_num_buckets": c.relative_attention_num_buckets,
        "relative_attention_max_distance": c.relative_attention_max_distance, "layer_norm_epsilon": c.norm_eps,
        "dropout_rate": c.dropout, "tie_word_embeddings": c.tie_word_embeddings,
        "scale_decoder_outputs": c.scale_output, "initializer_factor": c.init_factor, "is_encoder_decoder": True,
        "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1,
    }


def _pairs(c: T5Config) -> list[tuple[str, str]]:
    """(mg name, HF name) of every tensor except the embedding and head."""
    pairs = []
    for stack, n, decoder in (("encoder", c.num_layers, False), ("decoder", c.decoder_layers, True)):
        pairs.append((f"{stack}.relative_attention_bias.weight",
                      f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"))
        pairs.append((f"{stack}.final_layernorm.weight", f"{stack}.final_layer_norm.weight"))
        for i in range(n):
            mg, hf = f"{stack}.layers.{i}", f"{stack}.block.{i}.layer"
            attns = [("self_attention", "0.SelfAttention", "input_layernorm", "0.layer_norm")]
            if decoder:
                attns.append(("cross_attention", "1.EncDecAttention", "pre_cross_attn_layernorm", "1.layer_norm"))
            for mg_attn, hf_attn, mg_norm, hf_norm in attns:
                pairs.append((f"{mg}.{mg_norm}.weight", f"{hf}.{hf_norm}.weight"))
                for m, h in (("linear_q", "q"), ("linear_k", "k"), ("linear_v", "v"), ("linear_proj", "o")):
                    pairs.append((f"{mg}.{mg_attn}.{m}.weight", f"{hf}.{hf_attn}.{h}.weight"))
            ff = 2 if decoder else 1
            pairs.append((f"{mg}.pre_mlp_layernorm.weight", f"{hf}.{ff}.layer_norm.weight"))
            mlp = f"{hf}.{ff}.DenseReluDense"
            if c.activation == "gated-gelu":
                pairs += [(f"{mg}.mlp.linear_gate.weight", f"{mlp}.wi_0.weight"),
                          (f"{mg}.mlp.linear_fc1.weight", f"{mlp}.wi_1.weight")]
            else:
                pairs.append((f"{mg}.mlp.linear_fc1.weight", f"{mlp}.wi.weight"))
            pairs.append((f"{mg}.mlp.linear_fc2.weight", f"{mlp}.wo.weight"))
    return pairs


def state_from_hf(hf: dict[str, torch.Tensor], c: T5Config) -> dict[str, torch.Tensor]:
    """Unsharded mg T5 state dict from a Hugging Face one.

    Raises:
        ValueError: a tensor is missing, or the checkpoint holds tensors mg does not know.
    """
    hf = {k: v for k, v in hf.items() if k not in _ALIASES}
    if c.tie_word_embeddings:
        hf.pop("lm_head.weight", None)  # an alias of shared.weight when saved
    missing = [h for _, h in _pairs(c) if h not in hf] + [h for h in ("shared.weight",) if h not in hf]
    if not c.tie_word_embeddings and "lm_head.weight" not in hf:
        missing.append("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint is missing tensors {missing[:5]} required by its config.json")
    known = {h for _, h in _pairs(c)} | {"shared.weight", "lm_head.weight"}
    extra = sorted(set(hf) - known)
    if extra:
        raise ValueError(f"checkpoint holds tensors mg's T5 does not know: {extra[:5]}")
    return to_mg_state(tensor_groups(c), hf)


def tensor_groups(c: T5Config) -> list[TensorGroup]:
    """The model as per-tensor conversions (T5 tensors map one to one; the embedding and head are padded)."""
    groups = [mapped("shared.weight", "word_embeddings.weight", lambda w: pad_vocab(w, c),
                     lambda w: unpad_vocab(w, c))]
    if not c.tie_word_embeddings:
        groups.append(mapped("lm_head.weight", "output_layer.weight", lambda w: pad_vocab(w, c),
                             lambda w: unpad_vocab(w, c)))
    return groups + [rename(h, m) for m, h in _pairs(c)]


def is_ignored(name: str, c: T5Config) -> bool:
    """True for Hugging Face tensors that are aliases of others (the stacks' embeddings; a tied head)."""
    return name in _ALIASES or (c.tie_word_embeddings and name == "lm_head.weight")


def state_to_hf(mg: dict[str, torch.Tensor], c: T5Config) -> dict[str, torch.Tensor]:
    """Hugging Face T5 state dict (exact names, no aliases) from an unsharded mg one."""
    return to_hf_state(tensor_groups(c), mg)


def read_hf_t5(path: str | Path) -> tuple[T5Config, dict[str, torch.Tensor]]:
    """Read a Hugging Face T5 directory -> (T5Config, unsharded mg state dict).

    Raises:
        FileNotFoundError: no config.json or safetensors weights.
        ValueError: not a T5, unsupported feature or mismatched tensors.
    """
    path = Path(path)
    cfg_file, hf_config = read_config_json(path, "t5")
    config_from_hf(hf_config, str(cfg_file))  # config errors first, before reading weights
    hf_state = load_safetensors_dir(path)
    lm_head = hf_state.get("lm_head.weight")
    untied = lm_head is not None and not torch.equal(lm_head, hf_state["shared.weight"])
    config = config_from_hf(hf_config, str(cfg_file), has_lm_head=untied)
    return config, state_from_hf(hf_state, config)


def write_hf_t5(path: str | Path, mg_state: dict[str, torch.Tensor], config: T5Config) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in Hugging Face's T5 layout."""
    return write_hf_files(path, state_to_hf(mg_state, config), config_to_hf(config))
