"""Building one rank's training run: grid, model chunks, optimizer, schedule, data, and the resume policy."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from mg_cli.config import RunConfig
from mg_cli.job import Env
from mg_cli.training.setup import Plan, TrainingError


@dataclass
class StepInterval:
    """The steps since the last logged one: how many, their wall time, the compile clock when they began."""

    steps: int = 0
    seconds: float = 0.0
    compile_mark: float = 0.0


@dataclass
class Run:
    """Everything a rank's training loop works with, built once by :func:`build_run`."""

    config: RunConfig
    env: Env
    grid: Any
    """The process grid (``mg_parallel.ProcessGrid``)."""
    rng: Any
    """The RNG tracker shared with the model (dropout streams)."""
    model: list[Any]
    """This rank's DDP-wrapped model chunks (one per virtual pipeline stage)."""
    model_config: Any
    optimizer: Any
    schedule: Any
    """Learning rate as a function of the iteration."""
    data: Any
    """``RunData``: datasets and per-rank micro-batch iterators."""
    forward_backward: Any
    """The pipeline schedule (``forward_backward(forward_step, batches, model, num_micro, grid, ...)``)."""
    forward_step: Any
    logged_losses: tuple[str, ...]
    """Parts of the loss averaged and logged besides ``loss`` (BERT: ``lm_loss``, ``sop_loss``...)."""
    precision: Any
    """The precision policy (``mg_parallel.Precision``) the model was built, wrapped and is stepped in: the
    activations' dtype (``compute_dtype``), whether the loss is scaled (``needs_loss_scaling``)."""
    tensor_shape: tuple[int, int, int]
    """Shape of the activations passed between pipeline stages."""
    flops_per_token: float
    """Model FLOPs of one training step per token counted in ``tokens_per_s``."""
    saver: Any
    """The ``mg_ckpt.CheckpointSaver``: pending background saves, staging buffers, the checkpoint group."""
    start_iter: int
    """Iterations already done (those of the loaded checkpoint); the run goes on at ``start_iter + 1``."""
    init_report: str | None = None
    """What ``checkpoint.init_from`` loaded, initialised and dropped (one line), when it was used."""
    labels: tuple[list[str] | None, int] | None = None
    """Classification: (label names, or None for integer labels; number of labels), saved with checkpoints."""
    tokenizer: Any = None
    moe: Any = None
    """``MoEStep``: the MoE layers' per-step bookkeeping (aux-loss scale, expert bias, routing metrics)."""
    compile_clock: Any = None
    """``train.compile``: the ``CompileClock`` whose seconds the steps leave out of their time."""
    interval: StepInterval = field(default_factory=StepInterval)
    """The steps since the last logged one."""

    @property
    def num_micro(self) -> int:
        return self.data.micro_batches_per_step


def stage_positions(config: RunConfig, ds_config: Any, seq: int, grid: Any) -> int:
    """Positions of the activations a pipeline stage sends: this rank's ``seq`` tokens (split over tp under
    sequence parallelism); an encoder-decoder sends the encoder's positions and the decoder's."""
    from mg_cli.training.families import family

    fam = family(config)
    return fam.stage_positions(seq, fam.decoder_length(ds_config), tp=grid.tp_size,
                               sequence_parallel=grid.dims.sequence_parallel)


def build_run(config: RunConfig, env: Env, plan: Plan, load_path: str | None, saver: Any) -> Run:
    """Build the grid, model, optimizer, schedule and data, and restore ``load_path`` if given.

    Raises:
        TrainingError: the checkpoint cannot be loaded (names the file), or the data is unusable.
    """
    from mg_cli.training.build import build_model_chunks, wrap_and_build_optimizer
    from mg_cli.training.data import RunData
    from mg_cli.training.families import family
    from mg_parallel import build_grid
    from mg_parallel.pipeline import get_forward_backward_func
    from mg_parallel.tensor_parallel import RNGTracker

    t = config.train
    model_cfg = plan.model_config
    grid = build_grid(plan.dims)
    dims = grid.dims
    torch.manual_seed(t.seed)
    rng = RNGTracker(t.seed, grid)
    chunks = build_model_chunks(model_cfg, config, grid, rng, plan.precision)
    init_report = None
    if plan.pretrained is not None and load_path is None:  # weights only, before the optimizer copies them
        from mg_cli.training.pretrained import load_weights

        init_report = load_weights(chunks, grid, plan.pretrained)
    plan.pretrained = None  # its tensors are no longer needed
    model, optimizer = wrap_and_build_optimizer(chunks, config, grid, plan.precision)
    start_iter = 0
    if load_path is not None:
        start_iter = resume(load_path, config, env, grid, rng, model, optimizer, saver)
    data = RunData(config, grid, plan.tokenizer, plan.datasets)
    plan.datasets = None
    seq = config.model.seq_length // grid.cp_size  # this rank's tokens of each sample
    forward_backward = get_forward_backward_func(grid, dims.vpp if dims.vpp > 1 else None)
    if config.parallel.fsdp:  # gradients are DTensor shards: FSDP's own sequence-parallel and tied-embedding fix-ups
        from mg_parallel.distributed.fsdp import finalize_fsdp_grads

        forward_backward = functools.update_wrapper(
            functools.partial(forward_backward, finalize_grads=finalize_fsdp_grads), forward_backward)
    fam, task, fmt = family(config), config.data.sentence_task, config.data.format
    run = Run(
        config=config, env=env, grid=grid, rng=rng, model=model, model_config=model_cfg, optimizer=optimizer,
        schedule=plan.schedule, data=data,
        forward_backward=forward_backward,
        forward_step=fam.forward_step(fmt, sentence_task=task, cp_group=grid.cp_group if grid.cp_size > 1 else None),
        logged_losses=fam.logged_losses(fmt, task),
        precision=plan.precision,
        tensor_shape=(stage_positions(config, data.ds_config, seq, grid), t.micro_batch_size, model_cfg.hidden_size),
        flops_per_token=fam.flops_per_token(model_cfg, config.model.seq_length, data_format=fmt,
                                            dataset_config=data.ds_config,
                                            recompute=config.parallel.recompute_granularity == "full"),
        saver=saver, start_iter=start_iter, init_report=init_report, labels=plan.labels,
        tokenizer=plan.tokenizer,
    )
    from mg_cli.training.moe import MoEStep

    run.moe = MoEStep(run)
    if config.train.compile:
        from mg_cli.training.throughput import CompileClock

        run.compile_clock = CompileClock()
    return run


def resume(load_path: str, config: RunConfig, env: Env, grid: Any, rng: Any, model: list[Any], optimizer: Any,
           saver: Any = None) -> int:
    """Restore model, optimizer and RNG streams from ``load_path``; returns the iterations it holds.

    At the layout that saved it every rank gets its own RNG streams back (the continuation is
    bit-exact); at another layout the streams are reseeded from ``train.seed`` + the iteration, so
    dropout stays reproducible.

    Raises:
        TrainingError: the checkpoint cannot be read (names the file at fault).
    """
    from mg_ckpt import CheckpointError
    from mg_cli.training import checkpointing
    from mg_parallel.tensor_parallel import RNGTracker

    try:
        state = checkpointing.load(load_path, model, optimizer, grid, saver=saver)
    except CheckpointError as e:
        raise TrainingError(f"checkpoint.load: {e}") from None
    start_iter = int(state["iteration"])
    rngs = state.get("rng") or []
    if state.get("layout_key") == layout_key(grid, config) and len(rngs) == env.world_size:
        checkpointing.set_rng_state(rngs[env.rank], rng)
    else:  # a new layout has new dropout streams; keep them reproducible
        rng.set_state(RNGTracker(config.train.seed + start_iter, grid).get_state())
    return start_iter


def layout_key(grid: Any, config: RunConfig) -> str:
    """Identifies a layout in checkpoints: RNG streams are restored only at the same one."""
    p = config.parallel
    do = int(p.use_distributed_optimizer)
    cp = f"-cp{grid.cp_size}" if grid.cp_size > 1 else ""
    fsdp = f"-fsdp{p.fsdp_shard_size or grid.dp_size * grid.cp_size}" if p.fsdp else ""
    ep = f"-ep{grid.ep_size}-etp{grid.etp_size}" if grid.ep_size > 1 or grid.etp_size > 1 else ""
    return f"tp{grid.tp_size}-pp{grid.pp_size}-dp{grid.dp_size}-vpp{grid.dims.vpp}-do{do}{cp}{fsdp}{ep}"
