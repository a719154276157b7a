"""The run's model family as ``mg train`` uses it: the architecture from the ``model.*`` keys, the layout checks and
the special tokens from the tokenizer, with errors naming mg train's keys.

What differs between families (GPT, BERT, T5, or one another package installs) lives in their
:class:`mg_models.family.ModelFamily` objects: config class and presets, how a pipeline cuts the model, the
layouts it cannot run, its samples' special tokens, its forward step and loss, its FLOPs. Nothing here branches on
a family's name.
"""

from __future__ import annotations

from typing import Any

from mg_cli.config import ConfigError, RunConfig
from mg_cli.training.setup import TrainingError
from mg_models.family import FamilyError, ModelFamily, SpecialTokens, TokenLookup, families, get_family

__all__ = ["check_layout", "family", "model_config", "pad_id", "special_tokens"]


def family(config: RunConfig) -> ModelFamily:
    """The family of ``model.type``.

    Raises:
        TrainingError: no installed family has that name.
    """
    try:
        return get_family(config.model.type)
    except FamilyError as e:
        raise TrainingError(str(e)) from None


def _preset_fields(config: RunConfig, fam: ModelFamily) -> dict[str, Any]:
    m = config.model
    if m.preset is None:
        return {}
    presets = fam.presets()
    if m.preset not in presets:
        owner = next((f for f in families().values() if m.preset in f.presets()), None)
        if owner is None:
            raise TrainingError(f"model.preset={m.preset!r} is unknown; choose one of {sorted(presets)}")
        raise TrainingError(f"model.preset={m.preset!r} is not a {fam.name.upper()} preset (model.type={fam.name}); "
                            f"choose one of {sorted(presets)}")
    return dict(presets[m.preset])


def model_config(config: RunConfig, vocab_size: int, pretrained: Any = None, num_labels: int | None = None) -> Any:
    """The architecture of ``model.type``: the preset (if any), the ``model.*`` keys given (the fields of the
    family's config class, same names), and what the run fills in (the tokenizer's vocabulary, and what the family
    derives from the run: positions for ``model.seq_length``, one ``model.dropout`` for every dropout, BERT's binary
    head from ``data.sentence_task``).

    With ``pretrained`` (``checkpoint.init_from``) its architecture takes the preset's place.
    ``data.format: classification`` selects the classification head with the data's ``num_labels``.

    Raises:
        TrainingError: unknown preset, missing shape without a preset, a key the family does not use, or
            whatever the config class rejects (in its own words, naming the key).
    """
    m = config.model
    fam = family(config)
    try:
        cls = config.family_class("model", allow=("dropout",))
        fam.check_keys({"decoder_seq_length": m.decoder_seq_length, "activation": getattr(m, "activation", None)})
    except (ConfigError, FamilyError) as e:
        raise TrainingError(str(e)) from None
    if pretrained is not None:
        from mg_cli.training.pretrained import architecture

        if m.preset is not None:
            raise TrainingError("model.preset and checkpoint.init_from both give the architecture; leave "
                                "model.preset unset (model.* keys still override the pretrained model's)")
        base = architecture(pretrained, fam.name)
    else:
        base = _preset_fields(config, fam)
    fields = {**base, **config.values_for(cls)}
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if k not in fields]
    if missing:
        raise TrainingError(f"model.{missing[0]} is not set and model.preset is not given; set a preset or the shape")
    fields["vocab_size"] = vocab_size
    fields = fam.run_fields(fields, seq_length=m.seq_length, dropout=getattr(m, "dropout", None),
                            sentence_task=config.data.sentence_task)
    if config.data.format == "classification":
        if m.head not in (None, "classification") or m.num_labels not in (None, num_labels):
            raise TrainingError(f"data.format=classification trains a classification head over the data's "
                                f"{num_labels} labels; leave model.head and model.num_labels unset")
        fields.update(head="classification", num_labels=num_labels)
    try:
        return cls(**fields)  # the schema's class of the family (a subclass may add fields)
    except (TypeError, ValueError) as e:
        raise TrainingError(str(e)) from None


def check_layout(cfg: Any, config: RunConfig) -> None:
    """What the family cannot run at this layout (``parallel.*``, ``data.format``), as one-line errors naming the
    key; no collective."""
    p = config.parallel
    layout = {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "cp": p.cp, "cp_comm": p.cp_comm,
              "sequence_parallel": p.sequence_parallel, "fsdp": p.fsdp,
              "recompute_granularity": p.recompute_granularity, "data_format": config.data.format}
    try:
        family(config).check_layout(cfg, layout)
    except FamilyError as e:
        raise TrainingError(str(e)) from None


def pad_id(tokenizer: Any) -> int | None:
    """The tokenizer's padding id: its own pad id, else a ``<pad>``/``[PAD]`` token (None without one).

    Encoder-decoder models start their decoder inputs with it, so ``mg generate`` and ``mg convert`` use it as the
    decoder start id of checkpoints ``mg train`` wrote (Hugging Face's T5 does the same with its pad id 0).
    """
    return TokenLookup(tokenizer).pad


def special_tokens(config: RunConfig, tokenizer: Any, dataset_class: type | None = None) -> SpecialTokens:
    """The special-token ids ``config.model.type`` needs, looked up in the tokenizer.

    Raises:
        TrainingError: a needed token is missing; the message gives the ``mg tokenizer train`` options
            that add it.
    """
    from mg_models.family import MissingTokenError

    fam = family(config)
    try:
        cls = dataset_class or config.family_class("data")
        return fam.special_tokens(TokenLookup(tokenizer), data_format=config.data.format,
                                  seq_length=config.model.seq_length, dataset_class=cls)
    except MissingTokenError as e:
        raise TrainingError(f"data.tokenizer_model: {config.data.tokenizer_model} {e}") from None
    except (ConfigError, FamilyError) as e:
        raise TrainingError(str(e)) from None
