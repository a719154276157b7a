"""Training state <-> mg-ckpt logical tensors, so a checkpoint reshards to any layout on load.

Names:

* ``model/<param>``: each model parameter, global name (global layer index), global shape, as
  :func:`mg_models.loading.model_pieces` maps them (the model's own loading reads the same pieces).
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
from mg_models.loading import checkpoint_key, model_pieces, split_tied, unwrap
from mg_parallel.grid import ProcessGrid
from mg_parallel.tags import global_block, param_replicas

OPT_FIELDS = ("main_param", "exp_avg", "exp_avg_sq")


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
            key = checkpoint_key(module, name, param, grid, for_load=for_load)
            if key is None:
                continue
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
    state: dict[str, Any] = model_pieces(chunks, grid, for_load=False)
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
    pieces = model_pieces(chunks, grid, for_load=True)
    opt_state = None
    if load_optimizer:
        opt_pieces, opt_state = optimizer_state(optimizer, chunks, grid, for_load=True)
        pieces.update(opt_pieces)
    main, tied = split_tied(pieces)
    extra = load_checkpoint(path, main, saver=saver)
    # Collective: every rank takes part, also those without a tied copy (an empty template).
    load_checkpoint(path, tied, verify=False, saver=saver)
    if load_optimizer:
        saved = extra.get("optimizer", {})
        opt_state.update({k: v for k, v in saved.items() if k in ("step", "param_groups", "loss_scaler")})
        optimizer.load_state_dict(opt_state)
    return extra
