"""One way to get a model: build a family's model at a layout and precision, and fill it from an mg checkpoint
(saved at any layout), a Hugging Face directory, or nothing.

The precision is a :class:`mg_parallel.precision.Precision` policy (or its name): the parameters are built in its
dtype and every layer multiplies through its GEMM recipe, so the policy's recipe is what the model computes with.

:func:`load_model` is what ``mg train`` (fresh, ``checkpoint.init_from``), ``mg eval``, ``mg generate`` and
:func:`mg_models.load_pretrained` call; a resumed run loads the same model pieces (:func:`model_pieces`) with its
optimizer's in one read.

An mg checkpoint stores each parameter as ``model/<global name>`` with its global shape (``mg_ckpt`` logical
tensors). :func:`model_pieces` describes this rank's parameters as pieces of those tensors, through the one mapping
of a parameter to its global block (:func:`mg_parallel.tags.global_block`), so any layout reads any other's
checkpoint. A tied output weight on the last pipeline stage is a copy of the word embedding: it is not saved and
loads from the embedding.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mg_ckpt import CheckpointReader, ShardedTensor, load_checkpoint
from mg_models.family import FamilyError, ModelFamily, StageSpec, family_of, get_family
from mg_models.heads import WORD_EMBEDDING
from mg_parallel.gemm import use_gemm
from mg_parallel.grid import ProcessGrid
from mg_parallel.precision import Precision
from mg_parallel.tags import fsdp_shard, global_block, is_fsdp, is_pipeline_replicated, param_replicas

__all__ = [
    "MODEL_PREFIX",
    "LoadedModel",
    "build_model",
    "checkpoint_config",
    "checkpoint_key",
    "checkpoint_family",
    "copy_from_unsharded",
    "fill_model",
    "is_mg_checkpoint",
    "is_pipeline_copy",
    "is_tied_copy",
    "load_model",
    "model_pieces",
    "source_config",
    "split_tied",
    "tied_source",
    "unwrap",
]

MODEL_PREFIX = "model/"
"""Prefix of the model parameters among a checkpoint's tensors."""


# -- checkpoints ------------------------------------------------------------------------------------------------
def is_mg_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True for an ``iter_*`` directory holding metadata.json or a save directory with ``latest``."""
    p = Path(path)
    return (p / "metadata.json").is_file() or (p / "latest").is_file()


def checkpoint_family(extra: Mapping[str, Any]) -> str:
    """The model family recorded in a checkpoint's state (GPT's when absent, as in the first checkpoints)."""
    return str(extra.get("model_family", "gpt"))


def checkpoint_config(extra: Mapping[str, Any], where: str) -> Any:
    """The model config recorded in a checkpoint's state, as its family's config class.

    Raises:
        ValueError: no ``model_config`` (not written by ``mg train``/``mg convert``), an unknown family or config
            keys (naming ``where``).
    """
    if "model_config" not in extra:
        raise ValueError(f"{where}: no model_config in the checkpoint state; it was not written by mg train/convert")
    try:
        return get_family(checkpoint_family(extra)).config_from_dict(extra["model_config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {str(e).splitlines()[0]}") from None


def source_config(source: str | os.PathLike[str]) -> tuple[Any, dict[str, Any]]:
    """``(model config, checkpoint state)`` of an mg checkpoint (its recorded config) or a Hugging Face directory
    (its ``config.json`` and tensor names; state ``{}``), without reading the weights.

    Raises:
        FileNotFoundError: neither an mg checkpoint nor a directory with ``config.json``.
        ValueError, mg_ckpt.CheckpointError: an unsupported architecture, an unreadable checkpoint.
    """
    if is_mg_checkpoint(source):
        reader = CheckpointReader(os.fspath(source), verify=False)
        return checkpoint_config(reader.extra, reader.path), dict(reader.extra)
    if not (Path(source) / "config.json").is_file():
        raise FileNotFoundError(f"{source} is neither a Hugging Face model directory (no config.json) nor an mg "
                                f"checkpoint")
    from mg_ckpt import HFSafetensorsReader
    from mg_models.hf import config_from_hf, read_hf_config
    from mg_models.hf.common import read_config_json

    cfg_file, hf_config = read_config_json(Path(source))
    config_from_hf(hf_config, str(cfg_file))  # config errors first, before the weights are opened
    reader = HFSafetensorsReader(os.fspath(source))
    return read_hf_config(source, reader.weight_map, reader.read)[0], {}


# -- the mapping of parameters to checkpoint tensors ------------------------------------------------------------
def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model chunk inside a DDP/FSDP wrapper (or the chunk itself)."""
    return getattr(chunk, "module", chunk)


def is_tied_copy(module: torch.nn.Module, name: str) -> bool:
    # The last stage's own copy of a tied embedding (pp > 1).
    cfg = getattr(module, "config", None)
    return (name == "output_layer.weight" and cfg is not None and cfg.tie_word_embeddings
            and not getattr(module, "pre_process", True))


def tied_source(module: torch.nn.Module) -> str:
    """The global name of the word embedding a tied copy on ``module`` loads from."""
    return getattr(module, "tied_embedding_name", WORD_EMBEDDING)


def is_pipeline_copy(param: torch.Tensor, grid: ProcessGrid) -> bool:
    """A parameter every pipeline stage holds (T5's position bias tables), on a stage other than the first: the
    first stage's copy is the one saved."""
    return is_pipeline_replicated(param) and grid.pp_size > 1 and not grid.is_first_stage


def checkpoint_key(module: torch.nn.Module, name: str, param: torch.Tensor, grid: ProcessGrid, *, for_load: bool
                   ) -> str | None:
    """The global name a parameter is saved and loaded as: its own, or, for a tied copy, the embedding's (loaded
    only); None where this rank does not save it (a tied copy, a pipeline-replicated copy off the first stage)."""
    if is_pipeline_copy(param, grid) and not for_load:
        return None
    if is_tied_copy(module, name):
        return tied_source(module) if for_load else None
    return name


def model_pieces(chunks: list[torch.nn.Module], grid: ProcessGrid, *, for_load: bool) -> dict[str, ShardedTensor]:
    """This rank's model parameters as pieces of the checkpoint's logical tensors (templates filled in place on
    load). Keys are ``model/<global name>``; a tied copy's key ends in ``#tied`` (see :func:`split_tied`)."""
    out: dict[str, ShardedTensor] = {}
    for chunk in chunks:
        module = unwrap(chunk)
        # FSDP's shards are the fp32 main parameters; the model tensors are saved in the dtype the model computes
        # in, as without FSDP (the fp32 values travel as the optimizer's main_param).
        policy = getattr(chunk, "precision", None) if getattr(chunk, "fully_sharded", False) else None
        for name, param in module.named_parameters():
            key = checkpoint_key(module, name, param, grid, for_load=for_load)
            if key is None:
                continue
            gshape, goffset = global_block(param, grid.tp_size, grid.tp_rank, name=name)
            r, n = param_replicas(param, grid, dp_sharded=False, name=name)
            if for_load:
                r, n = 0, 1  # replica bookkeeping only matters when writing
            local, flat_range = param.data, None
            if is_fsdp(param):
                local, flat_range = fsdp_shard(param)
                if local.numel() == 0:
                    continue  # a parameter with fewer rows than the shard group: this rank holds none
                if not for_load and policy is not None and local.dtype != policy.param_dtype:
                    local = local.to(policy.param_dtype)
            out[MODEL_PREFIX + key + ("#tied" if key != name else "")] = ShardedTensor(
                local, gshape, goffset, local_shape=tuple(param.shape), flat_range=flat_range, replica_rank=r,
                num_replicas=n)
    return out


def split_tied(pieces: Mapping[str, ShardedTensor]) -> tuple[dict[str, ShardedTensor], dict[str, ShardedTensor]]:
    """(ordinary pieces, tied copies keyed by the embedding's name): '#tied' keys name the embedding's
    logical tensor, which the ordinary pieces may also hold, so they are loaded in a second pass."""
    main = {k: v for k, v in pieces.items() if "#" not in k}
    tied = {k.split("#")[0]: v for k, v in pieces.items() if "#" in k}
    return main, tied


def _param_name(key: str) -> str:
    """The parameter name of a :func:`model_pieces` key (no prefix, no ``#tied``)."""
    return key.removeprefix(MODEL_PREFIX).split("#")[0]


def copy_from_unsharded(chunks: list[torch.nn.Module], grid: ProcessGrid, state: Mapping[str, torch.Tensor]
                        ) -> tuple[set[str], list[str]]:
    """Copy this rank's block of each parameter of ``chunks`` from ``state`` (unsharded tensors by mg name; a tied
    output weight reads the word embedding).

    Returns:
        ``(names of state used, parameters state has no tensor for)``.

    Raises:
        ValueError: a tensor whose shape differs from the parameter's global shape (names both).
    """
    used, missing = set(), []
    for key, piece in model_pieces(chunks, grid, for_load=True).items():
        name = _param_name(key)
        source = state.get(name)
        if source is None:
            missing.append(name)
            continue
        if tuple(source.shape) != tuple(piece.global_shape):
            raise ValueError(f"{name} has shape {tuple(source.shape)} but {tuple(piece.global_shape)} in this model")
        index = tuple(slice(o, o + n) for o, n in zip(piece.global_offset, piece.local.shape))
        with torch.no_grad():
            piece.local.copy_(source[index])
        used.add(name)
    return used, missing


# -- building and filling ---------------------------------------------------------------------------------------
def build_model(config: Any, grid: ProcessGrid | None = None, *, precision: Precision | str | None = None,
                dtype: torch.dtype | None = None, vpp: int = 1, seed: int = 1234, rng_tracker: Any = None,
                recompute: Any = None, family: ModelFamily | None = None) -> list[torch.nn.Module]:
    """This rank's model chunks of ``config`` at ``grid`` (one per virtual pipeline stage; a single-process grid
    by default), with freshly initialised weights (values derive from ``(seed, global name)``, so every layout
    holds slices of the same global tensors).

    Args:
        precision: the policy (or its name, ``"fp32"``/``"bf16"``/``"fp16"``) the model computes in: its
            parameters are in its ``param_dtype`` and every layer multiplies through its GEMM recipe
            (:func:`mg_parallel.gemm.use_gemm` on each chunk). None: the default dtype and the plain recipe.
        dtype: the parameters' dtype when it is not the policy's (FSDP keeps the policy's fp32 main parameters
            as its shards and casts to the compute dtype itself); None: the policy's ``param_dtype``.

    Raises:
        ValueError: an unknown precision name (the message lists the valid ones).
    """
    grid = grid or ProcessGrid.single()
    family = family or family_of(config)
    policy = None if precision is None else Precision.resolve(precision)
    if dtype is None and policy is not None:
        dtype = policy.param_dtype
    ranges = family.chunk_ranges(config, grid.pp_size, vpp, grid.pp_rank)
    chunks = [family.build_stage(config, grid, StageSpec(
        layer_range=layers, pre_process=grid.is_first_stage and c == 0,
        post_process=grid.is_last_stage and c == len(ranges) - 1, sequence_parallel=grid.dims.sequence_parallel,
        seed=seed, rng_tracker=rng_tracker, recompute=recompute, dtype=dtype)) for c, layers in enumerate(ranges)]
    if policy is not None:
        for chunk in chunks:
            use_gemm(chunk, policy.gemm)
    return chunks


@dataclass
class LoadedModel:
    """What :func:`load_model` built and filled."""

    chunks: list[torch.nn.Module]
    """This rank's model chunks (one unless virtual pipeline stages)."""
    config: Any
    family: ModelFamily
    extra: dict[str, Any] = field(default_factory=dict)
    """The mg checkpoint's recorded state (iteration, tokenizer, ...); ``{}`` for other sources."""
    used: set[str] = field(default_factory=set)
    """Names of the source's tensors this rank loaded."""
    missing: list[str] = field(default_factory=list)
    """Parameters of this rank the source has no tensor for (left as initialised; only when not strict)."""
    source_names: set[str] = field(default_factory=set)
    """Every tensor name the source holds (for reporting what no rank used)."""

    @property
    def model(self) -> torch.nn.Module:
        """The one chunk (a single-stage model)."""
        if len(self.chunks) != 1:
            raise ValueError(f"the model has {len(self.chunks)} chunks here (virtual pipeline stages)")
        return self.chunks[0]


def fill_model(chunks: list[torch.nn.Module], grid: ProcessGrid, source: str | os.PathLike[str], *,
               strict: bool = True) -> LoadedModel:
    """Fill ``chunks`` from the mg checkpoint (read as the pieces this rank holds, at any layout) or Hugging Face
    directory at ``source`` (collective over the grid for an mg checkpoint).

    With ``strict=False`` parameters the source lacks keep their values (listed in ``missing``) and its tensors
    no parameter uses are left (see ``used`` / ``source_names``).

    Raises:
        ValueError: a tensor whose shape differs from the parameter's (names both), or, strict, a parameter the
            source lacks.
        FileNotFoundError, mg_ckpt.CheckpointError: an unreadable source (names the file).
    """
    config = unwrap(chunks[0]).config
    family = family_of(config)
    if not is_mg_checkpoint(source):
        from mg_models.hf import read_hf_directory

        _, state, _ = read_hf_directory(source)
        used, missing = copy_from_unsharded(chunks, grid, state)
        if strict and missing:
            raise ValueError(f"{source}: the model has parameters the checkpoint lacks: {missing[:5]}")
        return LoadedModel(chunks, config, family, used=used, missing=missing, source_names=set(state))
    reader = CheckpointReader(os.fspath(source), verify=False)
    held = {n.removeprefix(MODEL_PREFIX): shape for n, (shape, _) in reader.specs.items() if n.startswith(MODEL_PREFIX)}
    pieces = model_pieces(chunks, grid, for_load=True)
    missing = [_param_name(k) for k in pieces if _param_name(k) not in held]
    if strict and missing:
        raise ValueError(f"{reader.path}: the model has parameters the checkpoint lacks: {missing[:5]}")
    for key, piece in pieces.items():
        name = _param_name(key)
        if name in held and tuple(held[name]) != tuple(piece.global_shape):
            raise ValueError(f"{name} has shape {tuple(held[name])} but {tuple(piece.global_shape)} in this model")
    pieces = {k: v for k, v in pieces.items() if _param_name(k) in held}
    main, tied = split_tied(pieces)
    load_checkpoint(reader.path, main)
    if grid.world_size > 1 or tied:  # collective: every rank takes part, also those without a tied copy
        load_checkpoint(reader.path, tied, verify=False)
    used = {_param_name(k) for k in pieces}
    return LoadedModel(chunks, config, family, extra=dict(reader.extra), used=used, missing=missing,
                       source_names=set(held))


def load_model(source: str | os.PathLike[str] | None = None, *, config: Any = None, grid: ProcessGrid | None = None,
               precision: Precision | str | None = None, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None, strict: bool = True, inference: bool = False,
               **build: Any) -> LoadedModel:
    """Build a model at a layout and precision and fill it: the one way mg gets a model.

    Args:
        source: an mg checkpoint (``iter_*`` or a save directory, any family, saved at any layout), a Hugging Face
            directory, or None (fresh weights).
        config: the architecture; None takes the source's. Given with a source, it may differ where the source
            lacks tensors (a new classification head) when ``strict`` is False.
        grid: the layout (this rank's part of it); None: one process on ``device``.
        precision: the policy (or its name) the model computes in: parameters in its ``param_dtype``, every
            layer's matmuls through its GEMM recipe (see :func:`build_model`). None: the default dtype, plain recipe.
        dtype: parameter dtype when it is not the policy's (None: the policy's, else the default dtype).
        strict: every parameter must come from the source.
        inference: in eval mode, returning full unpadded logits by default (what scoring and generation want).
        build: more :func:`build_model` options (``vpp``, ``seed``, ``rng_tracker``, ``recompute``).

    Raises:
        ValueError: no config and no source, a source that does not match the model (names the tensor), an
            unsupported architecture, an unknown precision name.
        FileNotFoundError, mg_ckpt.CheckpointError: an unreadable source (names the file).
    """
    if grid is None:
        grid = ProcessGrid.single(torch.device(device) if device is not None else None)
    extra: dict[str, Any] = {}
    if config is None:
        if source is None:
            raise ValueError("load_model needs a source or a config")
        config, extra = source_config(source)
    try:
        family = family_of(config)
    except FamilyError as e:
        raise ValueError(str(e)) from None
    chunks = build_model(config, grid, precision=precision, dtype=dtype, family=family, **build)
    if inference:
        for chunk in chunks:
            chunk.gather_logits_default = True
            chunk.eval()
    if source is None:
        return LoadedModel(chunks, config, family)
    loaded = fill_model(chunks, grid, source, strict=strict)
    loaded.extra = loaded.extra or extra
    return loaded
