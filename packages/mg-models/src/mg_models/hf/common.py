"""Helpers shared by the Hugging Face adapters: reading and writing a model directory, vocabulary
padding and rotary layouts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mg_models.config import GPTConfig
from mg_models.hf.groups import TensorGroup, mapped, rename

__all__ = ["concat", "half_to_interleaved", "head_from_hf", "head_to_hf", "interleaved_to_half",
           "load_safetensors_dir", "output_groups", "pad_vocab", "read_config_json", "unpad_vocab", "write_hf_files"]

_CLASSIFICATION = "ForSequenceClassification"


def read_config_json(path: Path, model_type: str | None = None) -> tuple[Path, dict[str, Any]]:
    """``(path/config.json, its dict)`` of a Hugging Face model directory.

    Raises:
        FileNotFoundError: no config.json in ``path``.
        ValueError: ``model_type`` is given and the file's ``model_type`` differs.
    """
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found; expected a Hugging Face model directory")
    hf_config = json.loads(cfg_file.read_text())
    if model_type is not None and hf_config.get("model_type") != model_type:
        raise ValueError(f"{cfg_file}: model_type={hf_config.get('model_type')!r}, expected {model_type!r}")
    return cfg_file, hf_config


def head_from_hf(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The mg ``head``/``num_labels`` config fields of a Hugging Face config dict: ``head="classification"`` when its
    ``architectures`` name a ``*ForSequenceClassification`` (``num_labels`` from ``id2label``, else ``num_labels``,
    else 2, as Hugging Face counts them), else ``head="lm"``.

    Raises:
        ValueError: a ``problem_type`` mg's loss does not implement for that many labels (names the key).
    """
    if not any(a.endswith(_CLASSIFICATION) for a in hf.get("architectures") or []):
        return {"head": "lm"}
    num_labels = len(hf["id2label"]) if hf.get("id2label") else int(hf.get("num_labels") or 2)
    problem = hf.get("problem_type")
    expected = ("regression",) if num_labels == 1 else ("single_label_classification", "multi_label_classification")
    if problem is not None and problem not in expected:
        raise ValueError(f"{where}: problem_type={problem!r} with {num_labels} labels is not supported; mg trains "
                         f"one label as regression and several as single- or multi-label classification")
    return {"head": "classification", "num_labels": num_labels}


def head_to_hf(c: GPTConfig, prefix: str, lm_architecture: str) -> dict[str, Any]:
    """``architectures`` (``f"{prefix}ForSequenceClassification"`` for the classification head, else
    ``lm_architecture``) and, for the classification head, ``id2label``/``label2id`` keys of a Hugging Face
    config dict."""
    if c.has_lm_head:
        return {"architectures": [lm_architecture]}
    names = [f"LABEL_{i}" for i in range(c.num_labels)]
    return {"architectures": [f"{prefix}{_CLASSIFICATION}"], "id2label": {str(i): n for i, n in enumerate(names)},
            "label2id": {n: i for i, n in enumerate(names)}}


def load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``.

    Raises:
        FileNotFoundError: neither file exists.
    """
    single = path / "model.safetensors"
    if single.exists():
        return load_file(str(single))
    index = path / "model.safetensors.index.json"
    if index.exists():
        state: dict[str, torch.Tensor] = {}
        for f in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(load_file(str(path / f)))
        return state
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json; save the model with "
                            f"save_pretrained(..., safe_serialization=True)")


def write_hf_files(path: str | Path, hf_state: dict[str, torch.Tensor], hf_config: dict[str, Any]) -> Path:
    """Write ``config.json`` (sorted, indented) and ``model.safetensors`` (CPU, contiguous copies) into ``path``
    (created if needed); returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in hf_state.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    return path


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


def output_groups(c: GPTConfig, lm_head: str) -> list[TensorGroup]:
    """The GPT family's head tensors: the untied output layer (Hugging Face name ``lm_head``, vocabulary padded), none
    when tied, or the classification head's ``score.weight`` (the same name in both)."""
    if not c.has_lm_head:
        return [rename("score.weight", "score.weight")]
    if c.tie_word_embeddings:
        return []
    return [mapped(lm_head, "output_layer.weight", lambda w: pad_vocab(w, c), lambda w: unpad_vocab(w, c))]
