"""The BERT family as a model family: a bidirectional encoder trained with masked-LM (plus a sentence-order or
next-sentence head) or as a classifier."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from mg_models.bert.config import BertConfig
from mg_models.family import (
    CLASSIFICATION_DATASET,
    ForwardStep,
    ModelFamily,
    SpecialTokens,
    StageSpec,
    TokenLookup,
    check_head,
    missing_token,
)

if TYPE_CHECKING:
    import torch

    from mg_parallel.grid import ProcessGrid

__all__ = ["load_hf_bert", "BERT_SYMBOLS", "BertFamily"]

BERT_SYMBOLS = "<pad>,<cls>,<sep>,<mask>"
"""The ``--user-defined-symbols`` a SentencePiece tokenizer needs for BERT samples."""


def _classification_step(batch: dict[str, Any], chunk: Any) -> tuple[Any, Any]:
    output = chunk(batch["text"], batch["types"], batch["padding_mask"], labels=batch["label"])
    return output, lambda per_sample: (per_sample.float().mean(), {})


def _pretrain_step(batch: dict[str, Any], chunk: Any, *, sentence_task: str) -> tuple[Any, Any]:
    import torch.nn.functional as F

    from mg_models.losses import masked_mean

    # Every stage gets the padding mask (attention); the first the ids, the last the targets.
    output = chunk(batch["text"], batch["types"], batch["padding_mask"], lm_labels=batch["labels"])

    def loss_fn(out: tuple[Any, Any]) -> tuple[Any, dict[str, Any]]:
        lm, binary = out
        lm_loss = masked_mean(lm, batch["loss_mask"])
        if binary is None:
            return lm_loss, {"lm_loss": lm_loss.detach()}
        binary_loss = F.cross_entropy(binary.float(), batch["is_random"])
        return lm_loss + binary_loss, {"lm_loss": lm_loss.detach(), f"{sentence_task}_loss": binary_loss.detach()}
    return output, loss_fn


class BertFamily(ModelFamily):
    """BERT encoders (``model.type: bert``): masked-LM pretraining with a binary sentence head, or classification.

    Losses: masked-LM mean over the masked tokens + cross entropy of the binary (sentence-order or next-sentence)
    head over the samples; ``lm_loss`` and ``sop_loss`` / ``nsp_loss`` are logged too.
    """

    name = "bert"
    listing_order = 1
    config_class = BertConfig
    kind = "encoder"
    data_formats = ("pretrain", "classification")
    hf_model_types = ("bert",)
    run_filled_fields = ("vocab_size", "add_binary_head")
    dataset_classes = MappingProxyType({"pretrain": "mg_data.bert_dataset:BertDatasetConfig",
                                        "classification": CLASSIFICATION_DATASET})

    def presets(self) -> Mapping[str, Mapping[str, Any]]:
        from mg_models.bert.config import BERT_PRESETS

        return MappingProxyType(BERT_PRESETS)

    def run_fields(self, fields: Mapping[str, Any], *, seq_length: int, dropout: float | None,
                   sentence_task: str) -> dict[str, Any]:
        out = super().run_fields(fields, seq_length=seq_length, dropout=dropout, sentence_task=sentence_task)
        out["add_binary_head"] = sentence_task != "none"
        return out

    def check_layout(self, config: Any, layout: Mapping[str, Any]) -> None:
        check_head(config, layout.get("data_format", "pretrain"))
        super().check_layout(config, layout)

    def build_stage(self, config: Any, grid: ProcessGrid, stage: StageSpec) -> torch.nn.Module:
        from mg_models.bert.model import BertModel

        return BertModel(config, grid, pre_process=stage.pre_process, post_process=stage.post_process,
                         layer_range=stage.layer_range, sequence_parallel=stage.sequence_parallel, seed=stage.seed,
                         rng_tracker=stage.rng_tracker, recompute=stage.recompute, dtype=stage.dtype)

    def special_tokens(self, tokens: TokenLookup, *, data_format: str, seq_length: int,
                       dataset_class: Any = None) -> SpecialTokens:
        fix = f"--user-defined-symbols '{BERT_SYMBOLS}'"
        ids = {"padding token <pad>": tokens.pad, "<cls> token": tokens.piece("<cls>", "[CLS]"),
               "<sep> token": tokens.piece("<sep>", "[SEP]"), "<mask> token": tokens.mask}
        for what, value in ids.items():
            if value is None:
                raise missing_token(self.name, what, fix)
        pad, cls, sep, mask = ids.values()
        return SpecialTokens(pad=pad, cls=cls, sep=sep, mask=mask)

    def dataset_fields(self, data_format: str, ids: SpecialTokens, *, seq_length: int,
                       decoder_seq_length: int | None, vocab_size: int) -> dict[str, Any]:
        if data_format == "classification":
            return {"max_seq_length": seq_length, "cls_id": ids.cls, "sep_id": ids.sep, "pad_id": ids.pad}
        return {"max_seq_length": seq_length, "vocab_size": vocab_size, "cls_id": ids.cls, "sep_id": ids.sep,
                "mask_id": ids.mask, "pad_id": ids.pad}

    def forward_step(self, data_format: str, *, sentence_task: str = "none", cp_group: Any = None) -> ForwardStep:
        if data_format == "classification":
            return _classification_step
        return functools.partial(_pretrain_step, sentence_task=sentence_task)

    def logged_losses(self, data_format: str, sentence_task: str = "none") -> tuple[str, ...]:
        if data_format != "pretrain":
            return ()
        return ("lm_loss",) if sentence_task == "none" else ("lm_loss", f"{sentence_task}_loss")

    def flops_per_token(self, config: Any, seq_length: int, *, recompute: bool, data_format: str = "pretrain",
                        dataset_config: Any = None) -> float:
        """The MLM head runs on the masked positions only, at most ``masked_lm_prob`` of the sample's tokens."""
        from mg_models.flops import flops_per_token

        if data_format != "pretrain" or dataset_config is None:
            return flops_per_token(config, seq_length, recompute=recompute)
        masked = max(1, round(dataset_config.masked_lm_prob * dataset_config.max_num_tokens)) / seq_length
        return flops_per_token(config, seq_length, recompute=recompute, masked_lm_fraction=masked)

    def classify(self, model: torch.nn.Module, ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
        return model(ids, token_type_ids, attention_mask)

    def classification_ids(self, tokens: TokenLookup, a: list[int], b: list[int] | None, separator: int | None
                           ) -> tuple[list[int], list[int]]:
        """``[CLS] a [SEP] (b [SEP])`` with token types 0 for the first segment and 1 for the second."""
        cls, sep = tokens.piece("<cls>", "[CLS]"), tokens.piece("<sep>", "[SEP]")
        if cls is None or sep is None:
            raise ValueError("BERT classification needs <cls> and <sep> tokens in the tokenizer")
        ids = [cls, *a, sep] + ([*b, sep] if b is not None else [])
        return ids, [0] * (len(a) + 2) + ([1] * (len(b) + 1) if b is not None else [])

    def classify_kwargs(self, attention_mask: Any, token_type_ids: Any) -> dict[str, Any]:
        return {"token_type_ids": token_type_ids, "attention_mask": attention_mask}

    # -- Hugging Face -------------------------------------------------------------------------------------------
    def hf_config_from(self, hf_config: dict[str, Any], where: str, names: Any, read: Any) -> Any:
        from mg_models.bert import hf

        if names and "bert.pooler.dense.weight" not in names:  # no pooler: no binary head
            hf_config = {**hf_config, "architectures": ["BertForMaskedLM"]}
        return hf.config_from_hf(hf_config, where)

    def hf_config_to(self, config: Any, model_type: str) -> dict[str, Any]:
        from mg_models.bert import hf

        return hf.config_to_hf(config)

    def hf_state_from(self, hf_state: dict[str, Any], config: Any, model_type: str) -> dict[str, Any]:
        from mg_models.bert import hf

        return hf.state_from_hf(hf_state, config)

    def hf_state_to(self, mg_state: dict[str, Any], config: Any, model_type: str) -> dict[str, Any]:
        from mg_models.bert import hf

        return hf.state_to_hf(mg_state, config)

    def hf_tensor_groups(self, config: Any, model_type: str) -> list[Any]:
        from mg_models.bert import hf

        return hf.tensor_groups(config)

    def hf_tensor_ignored(self, name: str, config: Any, model_type: str) -> bool:
        from mg_models.bert import hf

        return hf.is_ignored(name)


def load_hf_bert(path: str | Path, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> torch.nn.Module:
    """A single-process BertModel from a Hugging Face ``BertForPreTraining`` / ``BertForMaskedLM`` /
    ``BertForSequenceClassification`` directory.

    ``model(input_ids, token_type_ids=None, attention_mask=None)`` returns ``(mlm_logits [b, s, vocab],
    binary_logits [b, 2] | None)``, comparable with Hugging Face's ``prediction_logits`` /
    ``seq_relationship_logits``; for a classification checkpoint, its ``logits`` [b, num_labels].

    Raises:
        FileNotFoundError: no config.json or safetensors weights.
        ValueError: unsupported architecture or mismatched tensors.
    """
    from mg_models.bert.hf import read_hf_bert

    config, state = read_hf_bert(path)
    try:
        return BertFamily().model_from_state(config, state, dtype=dtype, device=device)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
