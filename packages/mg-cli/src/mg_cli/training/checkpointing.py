"""Training state <-> mg-ckpt logical tensors, so a checkpoint reshards to any layout on load.

Names:

* ``model/<param>``: each model parameter, global name (global layer index), global shape;
  tensor-parallel shards are blocks of it. A tied output weight on the last pipeline stage is a
  copy of the word embedding and is not saved separately; it loads from the embedding.
* ``optim/<param>/{main_param,exp_avg,exp_avg_sq}``: fp32 optimizer state of the same parameter,
  with the same global shape. With the distributed optimizer each data-parallel rank owns a flat
  range of its tensor-parallel block, which mg-ckpt stores as such and reslices on load.
* Under ``parallel.fsdp`` a parameter (and its optimizer state) is a DTensor whose local shard is a flat
  range of its tensor-parallel block too, held by the HSDP replicas of that shard: the same names and
  global tensors, so a checkpoint moves between FSDP and DDP layouts without conversion.

Everything else (iteration, consumed samples, optimizer step, loss scaler, RNG streams of every
rank, the config) travels as JSON in the checkpoint's ``state``.
"""

from __future__ import annotations

import base64
from typing import Any

import torch
import torch.distributed as dist

from mg_ckpt import CheckpointSaver, ShardedTensor, load_checkpoint
from mg_parallel.grid import ProcessGrid
from mg_parallel.tags import fsdp_shard, global_block, is_fsdp, is_pipeline_replicated, param_replicas

WORD_EMBEDDING = "embedding.word_embeddings.weight"
OPT_FIELDS = ("main_param", "exp_avg", "exp_avg_sq")


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
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


def model_state(chunks: list[torch.nn.Module], grid: ProcessGrid, *, for_load: bool) -> dict[str, ShardedTensor]:
    """This rank's model parameters as logical-tensor pieces (templates filled in place on load)."""
    out: dict[str, ShardedTensor] = {}
    for chunk in chunks:
        module = unwrap(chunk)
        # FSDP's shards are the fp32 main parameters; the model tensors are saved in the dtype the model computes
        # in, as without FSDP (the fp32 values travel as the optimizer's main_param).
        policy = getattr(chunk, "precision", None) if getattr(chunk, "fully_sharded", False) else None
        for name, param in module.named_parameters():
            key = name
            if is_pipeline_copy(param, grid) and not for_load:
                continue
            if is_tied_copy(module, name):
                if not for_load:
                    continue
                key = tied_source(module)
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
            out[f"model/{key}" + ("#tied" if key != name else "")] = ShardedTensor(
                local, gshape, goffset, local_shape=tuple(param.shape), flat_range=flat_range, replica_rank=r,
                num_replicas=n)
    return out


def copy_from_unsharded(chunks: list[torch.nn.Module], grid: ProcessGrid, state: dict[str, torch.Tensor]
                        ) -> tuple[set[str], list[str]]:
    """Copy this rank's block of each parameter of ``chunks`` from ``state`` (unsharded tensors by mg name; a tied
    output weight reads the word embedding).

    Returns:
        ``(names of state used, parameters state has no tensor for)``.

    Raises:
        ValueError: a tensor whose shape differs from the parameter's global shape (names both).
    """
    used, missing = set(), []
    for key, piece in model_state(chunks, grid, for_load=True).items():
        name = key.removeprefix("model/").split("#")[0]
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


def optimizer_state(optimizer: Any, chunks: list[torch.nn.Module], grid: ProcessGrid, *, for_load: bool
                    ) -> tuple[dict[str, ShardedTensor], dict[str, Any]]:
    """The optimizer's tensors as logical-tensor pieces, plus its JSON part.

    Returns:
        ``(pieces, state)`` where ``state`` is ``optimizer.state_dict()``; on load, fill ``pieces``
        and pass ``state`` (whose tensors they alias) to ``optimizer.load_state_dict``.
    """
    state = optimizer.state_dict()
    distributed = bool(state["distributed"])
    out: dict[str, ShardedTensor] = {}
    for c, entries in enumerate(state["chunks"]):
        module = unwrap(chunks[c])
        params = dict(module.named_parameters())
        for name, entry in entries.items():
            param = params[name]
            key = name
            if is_pipeline_copy(param, grid) and not for_load:
                continue
            if is_tied_copy(module, name):
                if not for_load:
                    continue
                key = tied_source(module)
            gshape, goffset = global_block(param, grid.tp_size, grid.tp_rank, name=name)
            r, n = param_replicas(param, grid, dp_sharded=distributed, name=name)
            if for_load:
                r, n = 0, 1
            lo = int(entry["flat_offset"])
            for f in OPT_FIELDS:
                out[f"optim/{key}/{f}" + ("#tied" if key != name else "")] = ShardedTensor(
                    entry[f], gshape, goffset, local_shape=tuple(entry["shape"]),
                    flat_range=(lo, lo + int(entry["numel"])), replica_rank=r, num_replicas=n)
    return out, state


def _split_tied(pieces: dict[str, ShardedTensor]) -> tuple[dict[str, ShardedTensor], dict[str, ShardedTensor]]:
    """(ordinary pieces, tied copies keyed by the embedding's name): '#tied' keys name the embedding's
    logical tensor, which the ordinary pieces may also hold, so they are loaded in a second pass."""
    main = {k: v for k, v in pieces.items() if "#" not in k}
    tied = {k.split("#")[0]: v for k, v in pieces.items() if "#" in k}
    return main, tied


def rng_state(rng_tracker: Any) -> dict[str, Any]:
    """This rank's RNG streams as base64 strings (JSON-able)."""
    def enc(t: torch.Tensor) -> str:
        return base64.b64encode(t.cpu().numpy().tobytes()).decode()

    out = {"cpu": enc(torch.get_rng_state()), "tracker": {k: enc(v) for k, v in rng_tracker.get_state().items()}}
    if torch.cuda.is_available():
        out["cuda"] = enc(torch.cuda.get_rng_state())
    return out


def set_rng_state(state: dict[str, Any], rng_tracker: Any) -> None:
    """Restore :func:`rng_state` output."""
    def dec(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)

    torch.set_rng_state(dec(state["cpu"]))
    rng_tracker.set_state({k: dec(v) for k, v in state["tracker"].items()})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(dec(state["cuda"]))


def gather_rng(rng_tracker: Any) -> list[dict[str, Any]]:
    """Every rank's RNG state, by global rank (collective)."""
    mine = rng_state(rng_tracker)
    if not dist.is_initialized():
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def save(saver: CheckpointSaver, save_dir: str, iteration: int, chunks: list[torch.nn.Module], optimizer: Any,
         grid: ProcessGrid, extra: dict[str, Any], *, async_save: bool, keep_last: int | None) -> Any:
    """Save model + optimizer + ``extra`` as ``save_dir/iter_{iteration:07d}`` through ``saver`` (collective)."""
    state: dict[str, Any] = model_state(chunks, grid, for_load=False)
    opt_pieces, opt_state = optimizer_state(optimizer, chunks, grid, for_load=False)
    state.update(opt_pieces)
    extra = dict(extra)
    extra["optimizer"] = {k: v for k, v in opt_state.items() if k != "chunks"}
    layout = {"tp": grid.tp_size, "pp": grid.pp_size, "dp": grid.dp_size, "world_size": grid.world_size,
              **({"cp": grid.cp_size} if grid.cp_size > 1 else {})}
    # An async save copies the state while the next step's forward and backward run (they only
    # read it); the loop calls saver.wait_for_snapshot() before the optimizer step mutates it.
    return saver.save(save_dir, iteration, state, extra=extra, layout=layout, async_save=async_save,
                      background_snapshot=async_save, keep_last=keep_last)


def load(path: str, chunks: list[torch.nn.Module], optimizer: Any, grid: ProcessGrid, *, load_optimizer: bool = True,
         saver: CheckpointSaver | None = None) -> dict[str, Any]:
    """Load a checkpoint saved at any layout into this rank's model and optimizer (collective).

    Returns:
        The checkpoint's JSON ``state`` (iteration, consumed samples, RNG, config, ...).
    """
    pieces = model_state(chunks, grid, for_load=True)
    opt_state = None
    if load_optimizer:
        opt_pieces, opt_state = optimizer_state(optimizer, chunks, grid, for_load=True)
        pieces.update(opt_pieces)
    main, tied = _split_tied(pieces)
    extra = load_checkpoint(path, main, saver=saver)
    # Collective: every rank takes part, also those without a tied copy (an empty template).
    load_checkpoint(path, tied, verify=False, saver=saver)
    if load_optimizer:
        saved = extra.get("optimizer", {})
        opt_state.update({k: v for k, v in saved.items() if k in ("step", "param_groups", "loss_scaler")})
        optimizer.load_state_dict(opt_state)
    return extra
