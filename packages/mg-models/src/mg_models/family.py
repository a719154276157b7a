"""Model families as objects: what differs between GPT, BERT, T5 (and any family another package adds), in one
place per family.

A :class:`ModelFamily` owns its config class and presets, builds a pipeline stage of its model at a grid,
says how a pipeline cuts it and which layouts it cannot run, holds its Hugging Face adapter, the special
tokens its samples need, its forward step and loss for each data format it trains on, and its FLOPs per token.
Commands never branch on a family's name: they look the family up (:func:`get_family`, :func:`family_of`) and
ask it.

Families are found through the ``mg_models.families`` entry-point group (mg-models declares GPT, BERT and T5
there), so a family in another package works without a line of mg changed::

    [project.entry-points."mg_models.families"]
    mine = "my_package.family:MyFamily"   # a ModelFamily subclass or instance

Layering: this module imports no family; families import it (and the shared layers below it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from mg_parallel.grid import ProcessGrid

__all__ = [
    "CLASSIFICATION_DATASET",
    "FAMILY_GROUP",
    "FamilyError",
    "MissingTokenError",
    "ModelFamily",
    "SpecialTokens",
    "StageSpec",
    "TokenLookup",
    "check_head",
    "families",
    "family_for_hf",
    "family_of",
    "get_family",
    "missing_token",
]

CLASSIFICATION_DATASET = "mg_data.classification:ClassificationDatasetConfig"
"""Labelled-text samples (``data.format: classification``), the dataset of every family's classification head."""

FAMILY_GROUP = "mg_models.families"
"""Entry-point group of model families: ``name = "module:attribute"`` naming a :class:`ModelFamily` subclass or
instance."""


class FamilyError(ValueError):
    """A family name, config or checkpoint no installed family knows, or a family that cannot do what is asked."""


class MissingTokenError(FamilyError):
    """The tokenizer lacks a special token the family's samples need (:func:`missing_token`)."""


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the special tokens a family's samples use (None where the family needs none)."""

    pad: int | None = None
    eos: int | None = None
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None
    sentinels: tuple[int, ...] | None = None


@dataclass(frozen=True)
class StageSpec:
    """One pipeline chunk of a model: which layers, whether it holds the input and the output, how it runs."""

    layer_range: tuple[int, int]
    """``(start, stop)`` over the layers the pipeline cuts (:meth:`ModelFamily.pipeline_layers`)."""
    pre_process: bool = True
    """The chunk holds the embedding (first stage)."""
    post_process: bool = True
    """The chunk holds the output head (last stage)."""
    sequence_parallel: bool = False
    seed: int = 1234
    rng_tracker: Any = None
    recompute: Any = None
    """An ``mg_parallel.recompute.RecomputeConfig`` or None."""
    dtype: Any = None
    """dtype of the parameters (None: the default dtype)."""


def missing_token(family: str, what: str, fix: str) -> MissingTokenError:
    """The error for a tokenizer without a token ``family`` needs: names it and the ``mg tokenizer train``
    options (``fix``) that add it (the caller prefixes the tokenizer's key and path)."""
    return MissingTokenError(f"has no {what}, which model.type={family} needs; train a tokenizer with it: "
                       f"`mg tokenizer train --input ... --output-prefix ... {fix}` (then rerun `mg preprocess` "
                       f"with it)")


def check_head(config: Any, data_format: str) -> None:
    """A classification head trains on ``data.format=classification`` and an LM head on every other format.

    Raises:
        FamilyError: naming both keys.
    """
    head = getattr(config, "head", "lm")
    if (head == "lm") != (data_format != "classification"):
        raise FamilyError(f"model.head={head} does not fit data.format={data_format}: a classification head trains "
                          f"on data.format=classification, every other format on model.head=lm")


class TokenLookup:
    """What a family asks of a tokenizer: its own special ids (``pad``, ``eod``, ``mask``; None when it has none)
    and single-token pieces by text. Wraps mg-data's tokenizers (SentencePiece ``.sp`` or Hugging Face ``.tok``)
    without importing mg-data."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def pad(self) -> int | None:
        """The padding id: the tokenizer's own, else a ``<pad>``/``[PAD]`` token (None without one)."""
        own = getattr(self.tokenizer, "pad", None)
        return own if own is not None else self.piece("<pad>", "[PAD]")

    @property
    def eod(self) -> int | None:
        return getattr(self.tokenizer, "eod", None)

    @property
    def mask(self) -> int | None:
        own = getattr(self.tokenizer, "mask", None)
        return own if own is not None else self.piece("<mask>", "[MASK]")

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    def piece(self, *pieces: str) -> int | None:
        """Id of the first of ``pieces`` the tokenizer holds as one token (None when it holds none)."""
        sp = getattr(self.tokenizer, "sp", None)
        tok = getattr(self.tokenizer, "tok", None)
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


ForwardStep = Callable[[dict[str, Any], Any], tuple[Any, Callable[[Any], tuple[Any, dict[str, Any]]]]]
"""``forward_step(batch, chunk) -> (output, loss_fn)``; ``loss_fn(output) -> (loss, logs)`` (the pipeline
schedules' contract)."""


class ModelFamily:
    """One model family. Subclasses set the class attributes and override what their models do differently;
    the defaults describe a decoder-only language model built from ``mg_models.stage.PipelineStageModel``."""

    name: ClassVar[str]
    """The ``model.type`` users write, and the ``model_family`` recorded in checkpoints."""
    config_class: ClassVar[type]
    """The architecture dataclass (its fields are the ``model.*`` keys)."""
    kind: ClassVar[str] = "decoder"
    """``"decoder"`` (causal LM: generation, log-likelihoods), ``"encoder"`` (no generation) or
    ``"encoder-decoder"`` (generation decodes a target for each source)."""
    data_formats: ClassVar[tuple[str, ...]] = ("pretrain",)
    """The ``data.format`` values it trains on."""
    hf_model_types: ClassVar[tuple[str, ...]] = ()
    """Hugging Face ``config.json`` ``model_type`` values its adapter reads and writes."""
    dataset_classes: ClassVar[Mapping[str, str]] = MappingProxyType({})
    """``data.format`` -> ``"module:Class"`` of the sample-dataset config (its fields are the ``data.*`` keys)."""
    listing_order: ClassVar[int] = 100
    """Where the family comes in listings and messages (mg's own: gpt 0, bert 1, t5 2; then by name)."""
    run_filled_fields: ClassVar[tuple[str, ...]] = ("vocab_size",)
    """Config fields a training run fills in itself (not ``model.*`` keys)."""
    supports_context_parallel: ClassVar[bool] = False
    """Whether its models run with the sequence split over context-parallel ranks (``parallel.cp > 1``)."""

    # -- architecture -------------------------------------------------------------------------------------------
    def presets(self) -> Mapping[str, Mapping[str, Any]]:
        """Shapes by name: ``{preset: {config field: value}}``."""
        return MappingProxyType({})

    def config_from_dict(self, d: Mapping[str, Any]) -> Any:
        """The config from its ``to_dict()`` form (a checkpoint's record)."""
        return self.config_class.from_dict(dict(d))

    def owns(self, config: Any) -> bool:
        """Whether ``config`` is this family's (the most derived family owning a config wins)."""
        return isinstance(config, self.config_class)

    def run_fields(self, fields: Mapping[str, Any], *, seq_length: int, dropout: float | None,
                   sentence_task: str) -> dict[str, Any]:
        """What a training run fills into the config fields besides the tokenizer's vocabulary: positions for
        ``seq_length`` and one ``dropout`` for every dropout the family has (unless given)."""
        out = dict(fields)
        if dropout is not None:
            out.setdefault("attention_dropout", dropout)
            out.setdefault("hidden_dropout", dropout)
        out["max_position_embeddings"] = max(int(out.get("max_position_embeddings", 0)), seq_length)
        return out

    def check_keys(self, given: Mapping[str, Any]) -> None:
        """Raise ``FamilyError`` for ``model.*`` values this family does not take (beyond its config's own
        checks); ``given`` maps run-level keys (``decoder_seq_length``, ``activation``) to their values."""
        if given.get("decoder_seq_length") is not None:
            users = "/".join(f.name for f in families().values() if f.kind == "encoder-decoder")
            raise FamilyError(f"model.decoder_seq_length is only used by model.type={users}; leave it unset for "
                              f"{self.name}")

    # -- layout -------------------------------------------------------------------------------------------------
    def pipeline_layers(self, config: Any) -> tuple[int, str]:
        """``(layers a pipeline cuts into stages, how an error names them)``."""
        return config.pipeline_layers()

    def check_layout(self, config: Any, layout: Mapping[str, Any]) -> None:
        """Raise ``FamilyError`` naming the key for a layout this family cannot run. ``layout`` holds the
        ``parallel.*`` values (``tp``, ``pp``, ``vpp``, ``cp``, ``cp_comm``, ``sequence_parallel``, ``fsdp``,
        ``recompute_granularity``) and ``data_format``."""
        from mg_models.config import check_parallel

        try:
            check_parallel(config, layout.get("tp", 1), layout.get("pp", 1))
        except ValueError as e:
            raise FamilyError(str(e)) from None

    def chunk_ranges(self, config: Any, pp: int, vpp: int, pp_rank: int) -> list[tuple[int, int]]:
        """The ``(start, stop)`` layer range of each chunk pipeline rank ``pp_rank`` holds."""
        from mg_parallel.pipeline import partition_layers

        return [(r.start, r.stop) for r in partition_layers(self.pipeline_layers(config)[0], pp, vpp)[pp_rank]]

    def build_stage(self, config: Any, grid: ProcessGrid, stage: StageSpec) -> torch.nn.Module:
        """This rank's model chunk ``stage``."""
        raise NotImplementedError(f"model family {self.name!r} does not build models")

    def model_from_state(self, config: Any, state: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None,
                         device: torch.device | str | None = None) -> torch.nn.Module:
        """A single-process model of ``config`` holding ``state`` (unsharded mg names), in eval mode, returning
        full unpadded logits.

        Raises:
            ValueError: the state does not match the model (lists missing/unexpected keys).
        """
        import torch

        from mg_parallel.grid import ProcessGrid

        grid = ProcessGrid.single(torch.device(device) if device is not None else None)
        layers = self.pipeline_layers(config)[0]
        model = self.build_stage(config, grid, StageSpec(layer_range=(0, layers), dtype=dtype))
        result = model.load_state_dict(dict(state), strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise ValueError(f"checkpoint does not match the model: missing {result.missing_keys[:5]}, "
                             f"unexpected {result.unexpected_keys[:5]}")
        model.gather_logits_default = True
        return model.eval()

    def stage_positions(self, seq_length: int, decoder_length: int | None, *, tp: int, sequence_parallel: bool) -> int:
        """Positions of the activations a pipeline stage sends for ``seq_length``-token samples."""
        return seq_length // tp if sequence_parallel else seq_length

    # -- data ---------------------------------------------------------------------------------------------------
    def special_tokens(self, tokens: TokenLookup, *, data_format: str, seq_length: int,
                       dataset_class: Any = None) -> SpecialTokens:
        """The special-token ids this family's samples need (raise :func:`missing_token` for one the tokenizer
        lacks). ``dataset_class``: the sample-dataset config class of ``data_format`` (from
        :attr:`dataset_classes`), which a family may ask for lengths."""
        return SpecialTokens(eos=tokens.eod, pad=tokens.pad)

    def dataset_fields(self, data_format: str, ids: SpecialTokens, *, seq_length: int,
                       decoder_seq_length: int | None, vocab_size: int) -> dict[str, Any]:
        """What a run fills into the sample-dataset config of ``data_format`` (lengths, special ids)."""
        pad = ids.eos if ids.pad is None else ids.pad
        if data_format == "classification":  # the label is read at the last real token
            return {"max_seq_length": seq_length, "pad_id": pad, "separator_ids": [ids.eos]}
        if data_format == "sft":
            return {"seq_length": seq_length, "pad_id": pad}
        return {"seq_length": seq_length, "eod_id": ids.eos}

    def decoder_length(self, dataset_config: Any) -> int | None:
        """Decoder tokens per sample (encoder-decoder families), else None."""
        return None

    # -- training step ------------------------------------------------------------------------------------------
    def forward_step(self, data_format: str, *, sentence_task: str = "none", cp_group: Any = None) -> ForwardStep:
        """The micro-batch step for the pipeline schedules (see :data:`ForwardStep`)."""
        raise NotImplementedError(f"model family {self.name!r} does not train")

    def logged_losses(self, data_format: str, sentence_task: str = "none") -> tuple[str, ...]:
        """Keys of a micro-batch's logs averaged and logged besides ``loss``."""
        return ()

    def flops_per_token(self, config: Any, seq_length: int, *, recompute: bool, data_format: str = "pretrain",
                        dataset_config: Any = None) -> float:
        """Model FLOPs of one training step per token counted in ``tokens_per_s`` (matmuls, forward + backward)."""
        from mg_models.flops import flops_per_token

        return flops_per_token(config, seq_length, recompute=recompute)

    # -- inference ----------------------------------------------------------------------------------------------
    def context_length(self, config: Any) -> int:
        """The longest input the model takes (evaluation windows)."""
        return int(config.max_position_embeddings)

    def is_language_model(self, config: Any) -> bool:
        """Whether the model returns next-token logits (log-likelihood tasks and generation)."""
        return self.kind == "decoder" and getattr(config, "head", "lm") == "lm"

    def classify(self, model: torch.nn.Module, ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
        """Class logits ``[b, num_labels]`` of a classification-head model."""
        return model(ids, attention_mask=attention_mask)

    def classify_kwargs(self, attention_mask: Any, token_type_ids: Any) -> dict[str, Any]:
        """Keyword arguments of a classification forward (pipeline stages pass them to every stage)."""
        return {"attention_mask": attention_mask}

    def single_process_drops(self, config: Any) -> tuple[str, ...]:
        """Names of a checkpoint's model state a one-process model does not hold (a pipeline's tied copies)."""
        return ()

    def classification_ids(self, tokens: TokenLookup, a: list[int], b: list[int] | None, separator: int | None
                           ) -> tuple[list[int], list[int]]:
        """``(token ids, token types)`` of a classification example: text ``a`` and optional pair ``b`` (already
        encoded), joined as the family's classifier reads them (here ``a (separator b)``, types all 0)."""
        ids = a + ([separator, *b] if b is not None else [])
        return ids, [0] * len(ids)

    def decoder_start_token_id(self, extra: Mapping[str, Any]) -> int | None:
        """What generation starts the decoder with, from a checkpoint's recorded state (None: no decoder)."""
        return None

    def checkpoint_extra(self, dataset_config: Any) -> dict[str, Any]:
        """What a checkpoint records besides the config for inference (e.g. a decoder start id)."""
        return {}

    # -- Hugging Face -------------------------------------------------------------------------------------------
    def hf_config_from(self, hf_config: dict[str, Any], where: str, names: Any, read: Any) -> Any:
        """The mg config of a Hugging Face ``config.json`` dict (``names``: its tensors; ``read(name)``)."""
        raise FamilyError(f"model family {self.name!r} has no Hugging Face adapter")

    def hf_config_to(self, config: Any, model_type: str) -> dict[str, Any]:
        raise FamilyError(f"model family {self.name!r} has no Hugging Face adapter")

    def hf_state_from(self, hf_state: dict[str, Any], config: Any, model_type: str) -> dict[str, Any]:
        """Unsharded mg state dict from a Hugging Face one."""
        raise FamilyError(f"model family {self.name!r} has no Hugging Face adapter")

    def hf_state_to(self, mg_state: dict[str, Any], config: Any, model_type: str) -> dict[str, Any]:
        """Hugging Face state dict from an unsharded mg one."""
        raise FamilyError(f"model family {self.name!r} has no Hugging Face adapter")

    def hf_tensor_groups(self, config: Any, model_type: str) -> list[Any]:
        raise FamilyError(f"model family {self.name!r} has no Hugging Face adapter")

    def hf_tensor_ignored(self, name: str, config: Any, model_type: str) -> bool:
        return False

    def hf_export_type(self, config: Any, requested: str | None, recorded: str | None) -> str:
        """The Hugging Face ``model_type`` an export of ``config`` gets: ``requested`` (``--model-type``) when it is
        one of the family's, else the type the checkpoint was imported from, else :meth:`hf_model_type`.

        Raises:
            ValueError: ``requested`` is not one of the family's types.
        """
        if requested is not None and requested not in self.hf_model_types:
            fit = (f"--model-type {self.hf_model_types[0]}" if len(self.hf_model_types) == 1
                   else f"one of {list(self.hf_model_types)}")
            raise ValueError(f"--model-type {requested} does not fit this {self.hf_family_label} checkpoint; use {fit}")
        return requested or (recorded if recorded in self.hf_model_types else None) or self.hf_model_type(config)

    @property
    def hf_family_label(self) -> str:
        """How export errors name a checkpoint of this family."""
        return self.name

    def hf_token_ids(self, config: Any, model_type: str, tokens: TokenLookup) -> dict[str, Any]:
        """``config.json`` token ids an export takes from the tokenizer the run trained with (none by default)."""
        return {}

    def hf_import_extra(self, hf_config: Mapping[str, Any]) -> dict[str, Any]:
        """What an imported checkpoint records from the Hugging Face ``config.json`` for inference (none by
        default)."""
        return {}

    def hf_model_type(self, config: Any) -> str:
        """The Hugging Face ``model_type`` an export of ``config`` gets by default."""
        if not self.hf_model_types:
            raise FamilyError(f"model family {self.name!r} has no Hugging Face adapter")
        return self.hf_model_types[0]


@functools.cache
def families() -> Mapping[str, ModelFamily]:
    """Every installed family by name (the ``mg_models.families`` entry points, loaded once).

    Raises:
        FamilyError: an entry point that does not load or does not name a ModelFamily (one line naming it).
    """
    from importlib.metadata import entry_points

    found: dict[str, ModelFamily] = {}
    for ep in entry_points(group=FAMILY_GROUP):
        where = f"model family entry point {ep.name!r} = {ep.value!r}"
        try:
            obj = ep.load()
        except Exception as e:
            raise FamilyError(f"{where} failed to load: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}; "
                              f"reinstall the package that declares it") from None
        family = obj() if isinstance(obj, type) and issubclass(obj, ModelFamily) else obj
        if not isinstance(family, ModelFamily):
            raise FamilyError(f"{where} is a {type(obj).__name__}, not a mg_models.family.ModelFamily")
        if family.name != ep.name:
            raise FamilyError(f"{where} names a family called {family.name!r}; the entry point's name must be it")
        found[family.name] = family
    return MappingProxyType(dict(sorted(found.items(), key=lambda kv: (kv[1].listing_order, kv[0]))))


def get_family(name: str) -> ModelFamily:
    """The family called ``name`` (``model.type``).

    Raises:
        FamilyError: no installed family has that name (the message lists those that are).
    """
    known = families()
    if name not in known:
        raise FamilyError(f"model.type={name!r} is not an installed model family; choose one of {sorted(known)}")
    return known[name]


def family_of(config: Any) -> ModelFamily:
    """The family whose config class ``config`` is an instance of (the most derived class wins: a BERT config
    derives from GPT's).

    Raises:
        FamilyError: no installed family owns the config's class.
    """
    owners = [f for f in families().values() if f.owns(config)]
    if not owners:
        raise FamilyError(f"no installed model family builds a {type(config).__name__}")
    return max(owners, key=lambda f: len(f.config_class.__mro__))


def family_for_hf(model_type: str) -> ModelFamily:
    """The family whose Hugging Face adapter reads ``model_type``.

    Raises:
        FamilyError: no installed family does (the message lists the types that are supported).
    """
    for family in families().values():
        if model_type in family.hf_model_types:
            return family
    supported = sorted(t for f in families().values() for t in f.hf_model_types)
    raise FamilyError(f"Hugging Face model_type {model_type!r} is not supported; supported: {', '.join(supported)}")
