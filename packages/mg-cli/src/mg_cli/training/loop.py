"""The training loop behind ``mg train``.

One iteration = one global batch = one optimizer step; iterations count from 1 (Megatron's
convention), and checkpoint ``iter_{N:07d}`` holds the state after N iterations, so a resumed run
continues at N+1 with the same data (global batch N+1) and the same learning rate.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from mg_cli.config import RunConfig
from mg_cli.training.setup import Env, TrainingError, check_config, init_distributed, read_env, set_threads
from mg_cli.training.signals import SAVE, STOP, SignalFlag, signal_name


def _all_agree_max(values: list[float], grid: Any) -> list[float]:
    """The element-wise maximum of ``values`` over all ranks (so every rank takes the same decision)."""
    if not dist.is_initialized():
        return values
    t = torch.tensor([float(v) for v in values], device=grid.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _peak_mem(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return 0


def run_training(config: RunConfig, *, resume: bool = False, stop: SignalFlag | None = None) -> dict[str, Any]:
    """Train as configured; returns a summary (last loss, last validation loss, iterations run).

    ``stop`` records SIGTERM/SIGINT/SIGUSR1 (see :mod:`mg_cli.training.signals`); without it the
    run installs its own for its duration. After a signal-driven stop the summary holds
    ``signal`` (its number) and ``saved`` (the checkpoint written, or None).

    Raises:
        TrainingError: a configuration, data or checkpoint problem (one line), or a non-finite
            loss with fp32/bf16.
    """
    env = read_env()
    set_threads(config, env)
    tokenizer, model_cfg = preflight(config, env)  # before any collective: every rank fails alike
    load_path = _resolve_load(config, resume)

    own_flag = stop is None
    if stop is None:
        stop = SignalFlag(usr1_continues=config.checkpoint.on_signal == "save_and_continue").install()
    init_distributed(env)
    try:
        return _train(config, env, tokenizer, model_cfg, load_path, stop)
    finally:
        if own_flag:
            stop.restore()
        from mg_ckpt import finalize

        try:
            finalize()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def preflight(config: RunConfig, env: Env) -> tuple[Any, Any]:
    """Every check that needs no collective (config, layout, data files, tokenizer, model shape).

    ``mg train --nproc-per-node N`` runs it before starting the workers, so a bad config fails
    once, in one line, instead of once per rank.

    Returns:
        ``(tokenizer, model config)``.

    Raises:
        TrainingError: naming the key or file at fault.
    """
    check_config(config, env)
    from mg_data import build_tokenizer

    try:
        tokenizer = build_tokenizer(config.data.tokenizer_model)
    except (ValueError, OSError) as e:
        raise TrainingError(f"data.tokenizer_model: {e}") from None
    from mg_cli.training.build import check_model_layout, model_config
    from mg_cli.training.data import dataset_config

    model_cfg = model_config(config, tokenizer.vocab_size)
    check_model_layout(model_cfg, config)
    dataset_config(config, tokenizer, None)  # the family's special tokens and sample lengths
    return tokenizer, model_cfg


def _resolve_load(config: RunConfig, resume: bool) -> str | None:
    from mg_ckpt import latest_iteration

    c = config.checkpoint
    if c.load is not None:
        return c.load
    if resume and c.save is not None and os.path.isdir(c.save) and latest_iteration(c.save) is not None:
        return c.save
    return None


def _train(config: RunConfig, env: Env, tokenizer: Any, model_cfg: Any, load_path: str | None,
           stop: SignalFlag) -> dict[str, Any]:
    from mg_ckpt import wait_for_snapshot
    from mg_cli.training import checkpointing
    from mg_cli.training.build import PRECISION_DTYPES, build_model_chunks, wrap_and_build_optimizer
    from mg_cli.training.data import RunData
    from mg_cli.training.families import forward_step_for, logged_losses
    from mg_cli.training.metrics import MetricsLogger
    from mg_cli.training.schedule import LRSchedule
    from mg_cli.training.throughput import peak_flops, slower_than_fp32_note
    from mg_models import flops_per_token
    from mg_parallel import ParallelDims, build_grid
    from mg_parallel.pipeline import average_losses, get_forward_backward_func
    from mg_parallel.tensor_parallel import RNGTracker

    p, t, o = config.parallel, config.train, config.optim
    grid = build_grid(ParallelDims(tp=p.tp, pp=p.pp))
    torch.manual_seed(t.seed)
    rng = RNGTracker(t.seed, grid)
    chunks = build_model_chunks(model_cfg, config, grid, rng)
    model, optimizer = wrap_and_build_optimizer(chunks, config, grid)
    schedule = LRSchedule(lr=o.lr, min_lr=o.min_lr, warmup_iters=o.warmup_iters,
                          decay_iters=o.decay_iters if o.decay_iters is not None else t.iters,
                          style=o.decay_style, wsd_decay_fraction=o.wsd_decay_fraction)

    start_iter = 0
    if load_path is not None:
        from mg_ckpt import CheckpointError

        try:
            state = checkpointing.load(load_path, model, optimizer, grid)
        except CheckpointError as e:
            raise TrainingError(f"checkpoint.load: {e}") from None
        start_iter = int(state["iteration"])
        rngs = state.get("rng") or []
        same_layout = state.get("layout_key") == _layout_key(grid, config)
        if same_layout and len(rngs) == env.world_size:
            checkpointing.set_rng_state(rngs[env.rank], rng)
        else:  # a new layout has new dropout streams; keep them reproducible
            _reseed(rng, t.seed + start_iter, grid)

    data = RunData(config, grid, tokenizer)
    num_micro = data.micro_batches_per_step
    train_iter = data.train_iterator(start_iter * t.global_batch_size)
    valid = data.valid_batches() if config.eval.interval or config.eval.iters else None

    logger = MetricsLogger(config.log.dir, enabled=env.is_main, total_iters=t.iters, start_iter=start_iter,
                           tensorboard=config.log.tensorboard)
    if env.is_main:
        os.makedirs(config.log.dir, exist_ok=True)
        with open(os.path.join(config.log.dir, "config.yaml"), "w") as f:
            f.write(config.to_yaml())
    dtype = PRECISION_DTYPES[t.precision]
    seq = config.model.seq_length
    tensor_shape = (seq // grid.tp_size if p.sequence_parallel else seq, t.micro_batch_size, model_cfg.hidden_size)
    forward_backward = get_forward_backward_func(grid, p.vpp if p.vpp > 1 else None)
    peak = peak_flops(dtype, grid.device)  # per device: published for known GPUs, else measured here
    # What the run really does, read from the objects built (an option that was ignored shows here).
    settings = effective_settings(grid, model, optimizer, num_micro, forward_backward)
    if env.is_main:
        logger.message(f"mg train: {env.world_size} processes, "
                       + " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items())
                       + (f", resuming at iteration {start_iter + 1}" if start_iter else ""))
        slower = slower_than_fp32_note(t.precision, dtype, grid.device)
        if slower:
            logger.message(slower)
        logger.message("resolved config:\n" + config.to_yaml().rstrip())
        logger.record({"iteration": start_iter, "event": "start", "processes": env.world_size, "settings": settings,
                       "mfu_peak_tflops_per_device": peak.flops_per_s / 1e12, "mfu_peak_source": peak.source})
    family = config.model.type
    # T5: tokens are encoder tokens, and the FLOPs per encoder token include the decoder's share.
    # BERT: the MLM head runs on the masked positions only (at most this many per sample).
    ds = data.ds_config
    decoder_len = getattr(ds, "decoder_seq_length", None) or getattr(ds, "decoder_length", None)
    masked = None
    if family == "bert":
        masked = max(1, round(ds.masked_lm_prob * ds.max_num_tokens)) / seq
    flops_tok = flops_per_token(model_cfg, seq, recompute=p.recompute == "full", decoder_seq_length=decoder_len,
                                masked_lm_fraction=masked)
    started = time.monotonic()
    fp16 = t.precision == "fp16"

    forward_step = forward_step_for(family, config.data.sentence_task)
    extra_losses = logged_losses(family, config.data.sentence_task)

    saved_at = [None]

    def save(iteration: int, why: str = "") -> str | None:
        if config.checkpoint.save is None:
            if why:
                logger.message(f"{why}; checkpoint.save is not set, nothing saved")
            return None
        path = f"{config.checkpoint.save}/iter_{iteration:07d}"
        if saved_at[0] == iteration:
            if why:
                logger.message(f"{why}; checkpoint {path} already saved")
            return path
        extra = {
            "iteration": iteration,
            "consumed_samples": iteration * t.global_batch_size,
            "rng": checkpointing.gather_rng(rng),
            "layout_key": _layout_key(grid, config),
            "config": config.to_dict(),
            "model_family": family,
            "model_config": model_cfg.to_dict(),
            "tokenizer_model": os.path.abspath(config.data.tokenizer_model),
        }
        checkpointing.save(config.checkpoint.save, iteration, model, optimizer, grid, extra,
                           async_save=config.checkpoint.async_, keep_last=config.checkpoint.keep_last)
        saved_at[0] = iteration
        logger.message((f"{why}; saved" if why else "saved") + f" checkpoint {path}"
                       + (" (writing in the background)" if config.checkpoint.async_ else ""))
        return path

    def evaluate(iteration: int) -> float | None:
        if not valid:
            return None
        for chunk in model:
            chunk.eval()
        with torch.no_grad():
            losses = forward_backward(forward_step, iter(valid), model, len(valid), grid,
                                      tensor_shape=tensor_shape, dtype=dtype, forward_only=True)
        for chunk in model:
            chunk.train()
        val = float(average_losses(losses, grid))
        parts = {f"val_{k}": float(average_losses(losses, grid, key=k)) for k in extra_losses}
        # Perplexity of the language-model part (BERT: masked tokens, without the sentence-order loss).
        lm = parts.get("val_lm_loss", val)
        logger.log({"iteration": iteration, "val_loss": val, **parts, "val_ppl": math.exp(min(lm, 50.0))})
        return val

    last_loss = last_val = None
    iteration = start_iter
    try:
        while iteration < t.iters:
            iteration += 1
            lr = schedule(iteration)
            for group in optimizer.param_groups:
                group["lr"] = lr
            t0 = time.perf_counter()
            optimizer.zero_grad()
            losses = forward_backward(forward_step, train_iter, model, num_micro, grid, tensor_shape=tensor_shape,
                                      dtype=dtype, scale_loss=optimizer.scale_loss if fp16 else None)
            wait_for_snapshot()  # a background checkpoint copy must finish before the step mutates the state
            applied, grad_norm = optimizer.step()
            loss = float(average_losses(losses, grid))
            parts = {k: float(average_losses(losses, grid, key=k)) for k in extra_losses}
            if grid.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if not math.isfinite(loss) and not fp16:
                raise TrainingError(
                    f"loss is {loss} at iteration {iteration} ({t.precision}); lower optim.lr or check the data. "
                    f"Nothing was saved for this iteration"
                )
            last_loss = loss
            tokens_per_s = t.global_batch_size * seq / dt
            if iteration % config.log.interval == 0 or iteration == t.iters:
                logger.log({
                    "iteration": iteration, "loss": loss, **parts, "lr": lr,
                    "grad_norm": float(grad_norm) if grad_norm is not None else None,
                    "tokens_per_s": tokens_per_s,
                    "mfu": peak.utilization(flops_tok * tokens_per_s / grid.world_size),
                    "tflops_per_device": flops_tok * tokens_per_s / grid.world_size / 1e12,
                    "step_time_s": dt, "peak_mem_bytes": _peak_mem(grid.device), "skipped": not applied,
                    "loss_scale": float(optimizer.loss_scale) if fp16 else None,
                })
            if config.eval.interval and iteration % config.eval.interval == 0:
                last_val = evaluate(iteration)
            if config.checkpoint.interval and iteration % config.checkpoint.interval == 0 and iteration < t.iters:
                save(iteration)
            timed_out = (t.exit_after_minutes is not None
                         and time.monotonic() - started > 60 * t.exit_after_minutes)
            # One all-reduce per iteration: the strongest signal request of any rank, its signal, the time limit.
            request, signum, timed_out = (int(v) for v in _all_agree_max(
                [stop.request, stop.signum, float(timed_out)], grid))
            if iteration >= t.iters:
                pass  # the end-of-run save below
            elif request == STOP:
                path = save(iteration, f"stopping after iteration {iteration} on {signal_name(signum)}")
                return {"iteration": iteration, "loss": last_loss, "val_loss": last_val, "stopped": True,
                        "signal": signum, "saved": path}
            elif timed_out:
                save(iteration, f"stopping after iteration {iteration} on train.exit_after_minutes="
                                f"{t.exit_after_minutes}")
                return {"iteration": iteration, "loss": last_loss, "val_loss": last_val, "stopped": True}
            elif request == SAVE:
                stop.clear_save()
                save(iteration, f"{signal_name(signum)} after iteration {iteration}: continuing")
        if config.eval.interval == 0 or iteration % config.eval.interval != 0:
            if valid and iteration > start_iter:
                last_val = evaluate(iteration)
        if iteration > start_iter:
            save(iteration)
        return {"iteration": iteration, "loss": last_loss, "val_loss": last_val, "stopped": False}
    finally:
        logger.close()


def effective_settings(grid: Any, model: list[Any], optimizer: Any, num_micro: int,
                       forward_backward: Any) -> dict[str, Any]:
    """The settings that change execution, as the built grid, model chunks, optimizer and schedule have them.

    Keys: tp, pp, dp, vpp (model chunks on this rank), sequence_parallel, distributed_optimizer,
    recompute ("none", "full" or "full:<k> layers"), precision (of the model parameters),
    micro_batches (per optimizer step and data-parallel rank) and schedule (the pipeline schedule:
    no_pipelining, 1f1b or interleaved).
    """
    inner = [getattr(chunk, "module", chunk) for chunk in model]
    ctx = getattr(inner[0], "ctx", None)
    rc = getattr(ctx, "recompute", None)
    recompute = "none"
    if rc is not None and rc.granularity is not None:
        recompute = rc.granularity + (f":{rc.num_layers} layers" if rc.num_layers is not None else "")
    dtype = next(inner[0].parameters()).dtype
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    return {
        "tp": grid.tp_size, "pp": grid.pp_size, "dp": grid.dp_size, "vpp": len(inner),
        "sequence_parallel": bool(getattr(ctx, "sequence_parallel", False)),
        "distributed_optimizer": bool(optimizer.distributed), "recompute": recompute, "precision": precision,
        "micro_batches": num_micro, "schedule": getattr(forward_backward, "__name__", str(forward_backward)).removeprefix("forward_backward_"),
    }


def _layout_key(grid: Any, config: RunConfig) -> str:
    p = config.parallel
    return f"tp{grid.tp_size}-pp{grid.pp_size}-dp{grid.dp_size}-vpp{p.vpp}-do{int(p.distributed_optimizer)}"


def _reseed(rng: Any, seed: int, grid: Any) -> None:
    """Give ``rng`` (shared with the model) fresh streams for ``seed``; reseeds the default generator too."""
    from mg_parallel.tensor_parallel import RNGTracker

    rng.set_state(RNGTracker(seed, grid).get_state())
