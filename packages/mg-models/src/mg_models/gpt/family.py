"""The GPT family (GPT-2, Llama, Mistral, Qwen and their mixture-of-experts variants) as a model family."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from mg_models.config import GPTConfig
from mg_models.family import (
    CLASSIFICATION_DATASET,
    FamilyError,
    ForwardStep,
    ModelFamily,
    StageSpec,
    TokenLookup,
    check_head,
)

if TYPE_CHECKING:
    import torch

    from mg_parallel.grid import ProcessGrid

__all__ = ["GPTFamily"]


def _classification_step(batch: dict[str, Any], chunk: Any) -> tuple[Any, Any]:
    # Per-sample losses of the label read at each sequence's last real token: their mean.
    output = chunk(batch["tokens"], labels=batch["label"], attention_mask=batch["attention_mask"])
    return output, lambda per_sample: (per_sample.float().mean(), {})


class GPTFamily(ModelFamily):
    """Decoder-only language models (``model.type: gpt``) with an LM head or a classification head."""

    name = "gpt"
    listing_order = 0
    config_class = GPTConfig
    kind = "decoder"
    data_formats = ("pretrain", "sft", "classification")
    hf_model_types = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
    dataset_classes = MappingProxyType({"pretrain": "mg_data.gpt_dataset:GPTDatasetConfig",
                                        "sft": "mg_data.sft_dataset:SFTDatasetConfig",
                                        "classification": CLASSIFICATION_DATASET})
    supports_context_parallel = True

    def presets(self) -> Mapping[str, Mapping[str, Any]]:
        from mg_models.gpt.presets import PRESETS

        return MappingProxyType(PRESETS)

    def check_keys(self, given: Mapping[str, Any]) -> None:
        super().check_keys(given)
        if given.get("activation") in ("relu", "gated-gelu"):
            raise FamilyError(f"model.activation={given['activation']} is a T5 activation; use gelu, gelu_tanh or "
                              f"swiglu for gpt")

    def check_layout(self, config: Any, layout: Mapping[str, Any]) -> None:
        from mg_models.layers import check_context_parallel

        check_head(config, layout.get("data_format", "pretrain"))
        super().check_layout(config, layout)
        try:
            check_context_parallel(config, layout.get("tp", 1), layout.get("cp", 1), layout.get("cp_comm", "p2p"))
        except ValueError as e:
            raise FamilyError(str(e)) from None

    def build_stage(self, config: Any, grid: ProcessGrid, stage: StageSpec) -> torch.nn.Module:
        from mg_models.gpt.model import GPTModel

        return GPTModel(config, grid, pre_process=stage.pre_process, post_process=stage.post_process,
                        layer_range=stage.layer_range, sequence_parallel=stage.sequence_parallel, seed=stage.seed,
                        rng_tracker=stage.rng_tracker, recompute=stage.recompute, dtype=stage.dtype)

    def forward_step(self, data_format: str, *, sentence_task: str = "none", cp_group: Any = None) -> ForwardStep:
        from mg_models.losses import sft_step, token_step

        if data_format == "classification":
            return _classification_step
        step = sft_step if data_format == "sft" else token_step
        return functools.partial(step, cp_group=cp_group) if cp_group is not None else step

    def single_process_drops(self, config: Any) -> tuple[str, ...]:
        """A tied head's copy on the last pipeline stage (one process ties it to the embedding)."""
        return ("output_layer.weight",) if config.tie_word_embeddings else ()

    # -- Hugging Face -------------------------------------------------------------------------------------------
    def hf_config_from(self, hf_config: dict[str, Any], where: str, names: Any, read: Any) -> Any:
        from mg_models.gpt import hf

        return hf.config_from_hf(hf_config, where)

    def hf_config_to(self, config: Any, model_type: str) -> dict[str, Any]:
        from mg_models.gpt import hf

        return hf.config_to_hf(config, model_type)

    def hf_state_from(self, hf_state: dict[str, Any], config: Any, model_type: str) -> dict[str, Any]:
        from mg_models.gpt import hf

        return hf.state_from_hf(hf_state, config, model_type)

    def hf_state_to(self, mg_state: dict[str, Any], config: Any, model_type: str) -> dict[str, Any]:
        from mg_models.gpt import hf

        return hf.state_to_hf(mg_state, config, model_type)

    def hf_tensor_groups(self, config: Any, model_type: str) -> list[Any]:
        from mg_models.gpt import hf

        return hf.tensor_groups(config, model_type)

    def hf_tensor_ignored(self, name: str, config: Any, model_type: str) -> bool:
        from mg_models.gpt import hf

        return hf.is_ignored(name, config)

    def hf_model_type(self, config: Any) -> str:
        """GPT-2 for learned positions, else Llama."""
        return "gpt2" if config.position_embedding == "learned" else "llama"

    @property
    def hf_family_label(self) -> str:
        return "GPT"

    def hf_token_ids(self, config: Any, model_type: str, tokens: TokenLookup) -> dict[str, Any]:
        """A classifier's padding (its head reads the last token that is not padding, as mg's did; mg padded with
        the pad token, else with eod)."""
        if config.has_lm_head:
            return {}
        return {"pad_token_id": int(tokens.eod if tokens.pad is None else tokens.pad)}
