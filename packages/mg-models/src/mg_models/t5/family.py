"""The T5 family as a model family: encoder-decoder models trained on span corruption or input -> target pairs."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from mg_models.family import (
    FamilyError,
    ForwardStep,
    ModelFamily,
    SpecialTokens,
    StageSpec,
    TokenLookup,
    missing_token,
)
from mg_models.t5.config import T5Config

if TYPE_CHECKING:
    import torch

    from mg_parallel.grid import ProcessGrid

__all__ = ["load_hf_t5", "T5_CONTEXT", "T5Family"]

T5_CONTEXT = 512
"""The context evaluation gives a T5 model: its relative positions have no length limit, and T5 was pretrained on
512-token inputs."""


def _step(batch: dict[str, Any], chunk: Any) -> tuple[Any, Any]:
    from mg_models.losses import masked_mean

    # Decoder padding follows every target, so the causal mask alone keeps real positions off it. Every stage gets
    # the ids (their lengths) and the source mask; the last stage returns (per-token loss, encoder output).
    output = chunk(batch["text_enc"], batch["text_dec"], batch["enc_mask"], labels=batch["labels"])

    def loss_fn(out: tuple[Any, Any]) -> tuple[Any, dict[str, Any]]:
        loss = masked_mean(out[0], batch["loss_mask"])
        return loss, {"lm_loss": loss.detach()}
    return output, loss_fn


class T5Family(ModelFamily):
    """T5 encoder-decoders (``model.type: t5``). Loss: the mean decoder token loss over the targets
    (``loss_mask``), logged as ``loss`` and ``lm_loss``."""

    name = "t5"
    listing_order = 2
    config_class = T5Config
    kind = "encoder-decoder"
    data_formats = ("pretrain", "seq2seq")
    hf_model_types = ("t5",)
    dataset_classes = MappingProxyType({"pretrain": "mg_data.t5_dataset:T5DatasetConfig",
                                        "seq2seq": "mg_data.seq2seq:Seq2SeqDatasetConfig"})

    def presets(self) -> Mapping[str, Mapping[str, Any]]:
        from mg_models.t5.config import T5_PRESETS

        return MappingProxyType(T5_PRESETS)

    def run_fields(self, fields: Mapping[str, Any], *, seq_length: int, dropout: float | None,
                   sentence_task: str) -> dict[str, Any]:
        return dict(fields)  # relative positions: no position table; ``model.dropout`` is T5's own field

    def check_keys(self, given: Mapping[str, Any]) -> None:
        pass  # decoder_seq_length and T5's activations are its own

    def check_layout(self, config: Any, layout: Mapping[str, Any]) -> None:
        """What T5 training does not support, as one-line errors naming the key."""
        vpp, pp = layout.get("vpp", 1), layout.get("pp", 1)
        if vpp > 1:
            raise FamilyError(f"parallel.vpp={vpp}: the interleaved pipeline schedule is not supported for "
                              f"model.type=t5; use parallel.vpp=1 (parallel.pp alone cuts the encoder and decoder "
                              f"layers into stages)")
        if pp > 1 and layout.get("fsdp"):
            raise FamilyError(f"parallel.fsdp with parallel.pp={pp} is not supported for model.type=t5; use the "
                              f"distributed optimizer (parallel.distributed_optimizer=true) with the pipeline")
        if layout.get("sequence_parallel"):
            raise FamilyError("parallel.sequence_parallel is not supported for model.type=t5; set it to false")
        if layout.get("recompute_granularity") is not None:
            raise FamilyError(f"parallel.recompute_granularity={layout['recompute_granularity']} is not supported "
                              f"for model.type=t5; leave it unset")
        super().check_layout(config, layout)

    def build_stage(self, config: Any, grid: ProcessGrid, stage: StageSpec) -> torch.nn.Module:
        from mg_models.t5.model import T5Model

        return T5Model(config, grid, pre_process=stage.pre_process, post_process=stage.post_process,
                       layer_range=stage.layer_range, seed=stage.seed, rng_tracker=stage.rng_tracker, dtype=stage.dtype)

    def stage_positions(self, seq_length: int, decoder_length: int | None, *, tp: int, sequence_parallel: bool) -> int:
        """The encoder's positions and the decoder's (every stage sends both)."""
        return seq_length + (decoder_length or 0)

    def special_tokens(self, tokens: TokenLookup, *, data_format: str, seq_length: int,
                       dataset_class: Any = None) -> SpecialTokens:
        seq2seq = data_format == "seq2seq"  # input -> target pairs: no span corruption, no sentinels
        spans = 0 if seq2seq else self.noise_spans(dataset_class, seq_length)
        fix = "--user-defined-symbols '<pad>'" + ("" if seq2seq else f" --extra-ids {max(100, spans)}")
        pad = tokens.pad
        if pad is None:
            raise missing_token(self.name, "padding token <pad>", fix)
        if tokens.eod is None:
            raise missing_token(self.name, "end-of-sequence token </s>", fix)
        sentinels = []
        for k in range(spans):
            i = tokens.piece(f"<extra_id_{k}>")
            if i is None:
                raise missing_token(self.name, f"sentinel token <extra_id_{k}> (model.seq_length={seq_length} needs "
                                    f"{spans} sentinels, <extra_id_0>..<extra_id_{spans - 1}>)", fix)
            sentinels.append(i)
        return SpecialTokens(pad=pad, eos=tokens.eod, sentinels=tuple(sentinels))

    @staticmethod
    def noise_spans(dataset_class: Any, encoder_length: int) -> int:
        """Noise spans per sample of span corruption at ``encoder_length`` (the dataset config computes it).

        Raises:
            FamilyError: ``encoder_length`` too short for span corruption.
        """
        try:
            probe = dataset_class(encoder_seq_length=encoder_length, sentinel_ids=range(encoder_length), eos_id=0,
                                  pad_id=0)
        except ValueError as e:
            raise FamilyError(f"model.seq_length={encoder_length}: {e}") from None
        return probe.num_noise_spans

    def dataset_fields(self, data_format: str, ids: SpecialTokens, *, seq_length: int,
                       decoder_seq_length: int | None, vocab_size: int) -> dict[str, Any]:
        if data_format == "seq2seq":
            return {"encoder_seq_length": seq_length, "decoder_seq_length": decoder_seq_length or seq_length,
                    "eos_id": ids.eos, "pad_id": ids.pad}
        return {"encoder_seq_length": seq_length, "sentinel_ids": list(ids.sentinels or ()), "eos_id": ids.eos,
                "pad_id": ids.pad, "decoder_seq_length": decoder_seq_length}

    def decoder_length(self, dataset_config: Any) -> int | None:
        """A sample's decoder length: the padded ``decoder_seq_length`` or, unset, the span-corruption target's."""
        return dataset_config.decoder_seq_length or dataset_config.decoder_length

    def forward_step(self, data_format: str, *, sentence_task: str = "none", cp_group: Any = None) -> ForwardStep:
        return _step

    def logged_losses(self, data_format: str, sentence_task: str = "none") -> tuple[str, ...]:
        return ("lm_loss",)

    def flops_per_token(self, config: Any, seq_length: int, *, recompute: bool, data_format: str = "pretrain",
                        dataset_config: Any = None) -> float:
        """Per encoder token, the decoder's share included (its length from the dataset config)."""
        from mg_models.flops import flops_per_token

        decoder = None if dataset_config is None else self.decoder_length(dataset_config)
        return flops_per_token(config, seq_length, recompute=recompute, decoder_seq_length=decoder)

    def context_length(self, config: Any) -> int:
        return T5_CONTEXT

    def decoder_start_token_id(self, extra: Mapping[str, Any]) -> int | None:
        start = extra.get("decoder_start_token_id")
        return 0 if start is None else int(start)

    def checkpoint_extra(self, dataset_config: Any) -> dict[str, Any]:
        ds = dataset_config
        start = getattr(ds, "decoder_start_id", None)
        return {"decoder_start_token_id": int(ds.pad_id if start is None else start)}

    def hf_token_ids(self, config: Any, model_type: str, tokens: TokenLookup) -> dict[str, Any]:
        """The pad id (also the decoder start, as mg training starts targets with it) and the end of sequence."""
        out: dict[str, Any] = {} if tokens.pad is None else {"pad_token_id": tokens.pad,
                                                              "decoder_start_token_id": tokens.pad}
        if tokens.eod is not None:
            out["eos_token_id"] = int(tokens.eod)
        return out

    def hf_import_extra(self, hf_config: Mapping[str, Any]) -> dict[str, Any]:
        """The decoder start id (Hugging Face's default for T5: 0, its pad id)."""
        start = hf_config.get("decoder_start_token_id")
        return {"decoder_start_token_id": int(start) if start is not None else 0}

    def classify(self, model: torch.nn.Module, ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
        raise FamilyError("classification tasks need a GPT or BERT model with a classification head, not T5")

    # -- Hugging Face -------------------------------------------------------------------------------------------
    def hf_config_from(self, hf_config: dict[str, Any], where: str, names: Any, read: Any) -> Any:
        import torch

        from mg_models.t5 import hf

        hf.config_from_hf(hf_config, where)  # config errors before reading weights
        untied = (read is not None and "lm_head.weight" in names
                  and not torch.equal(read("lm_head.weight"), read("shared.weight")))
        return hf.config_from_hf(hf_config, where, has_lm_head=untied)

    def hf_config_to(self, config: Any, model_type: str) -> dict[str, Any]:
        from mg_models.t5 import hf

        return hf.config_to_hf(config)

    def hf_state_from(self, hf_state: dict[str, Any], config: Any, model_type: str) -> dict[str, Any]:
        from mg_models.t5 import hf

        return hf.state_from_hf(hf_state, config)

    def hf_state_to(self, mg_state: dict[str, Any], config: Any, model_type: str) -> dict[str, Any]:
        from mg_models.t5 import hf

        return hf.state_to_hf(mg_state, config)

    def hf_tensor_groups(self, config: Any, model_type: str) -> list[Any]:
        from mg_models.t5 import hf

        return hf.tensor_groups(config)

    def hf_tensor_ignored(self, name: str, config: Any, model_type: str) -> bool:
        from mg_models.t5 import hf

        return hf.is_ignored(name, config)


def load_hf_t5(path: str | Path, *, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> torch.nn.Module:
    """A single-process T5Model from a Hugging Face ``T5ForConditionalGeneration`` directory.

    ``model(input_ids, decoder_input_ids=..., attention_mask=None)`` returns ``(logits [b, t, vocab],
    encoder_output)``, comparable with Hugging Face's ``logits``.

    Raises:
        FileNotFoundError: no config.json or safetensors weights.
        ValueError: unsupported architecture or mismatched tensors.
    """
    from mg_models.t5.hf import read_hf_t5

    config, state = read_hf_t5(path)
    try:
        return T5Family().model_from_state(config, state, dtype=dtype, device=device)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
