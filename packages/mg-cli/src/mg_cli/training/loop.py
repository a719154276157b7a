"""The training loop behind ``mg train``.

One iteration = one global batch = one optimizer step; iterations count from 1 (Megatron's
convention), and checkpoint ``iter_{N:07d}`` holds the state after N iterations, so a resumed run
continues at N+1 with the same data (global batch N+1) and the same learning rate.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from mg_cli.config import RunConfig
from mg_cli.job import Env, init_distributed, read_env
from mg_cli.training.setup import (
    Plan,
    TrainingError,
    check_config,
    resolve_precision,
    set_threads,
)
from mg_cli.training.signals import SAVE, STOP, SignalFlag


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
    plan = preflight(config, env)  # before any collective: every rank fails alike
    load_path = _resolve_load(config, resume)

    own_flag = stop is None
    if stop is None:
        stop = SignalFlag(usr1_continues=config.checkpoint.on_signal == "save_and_continue").install()
    init_distributed(env)
    from mg_ckpt import CheckpointError, CheckpointSaver
    from mg_cli.training.allocator import keep_freed_memory
    from mg_parallel.device import cuda_usable

    try:
        # Collective (creates the checkpoint group). Leaving the block waits for a background save and
        # raises its error; when the run itself failed, that error is only a warning.
        with keep_freed_memory(not cuda_usable()), CheckpointSaver() as saver:
            return _train(config, env, plan, load_path, stop, saver)
    except CheckpointError as e:
        raise TrainingError(f"checkpoint.save: {str(e).splitlines()[0]}") from None
    finally:
        if own_flag:
            stop.restore()
        if dist.is_initialized():
            dist.destroy_process_group()


def preflight(config: RunConfig, env: Env) -> Plan:
    """Every check that needs no collective (config, layout, data files, tokenizer, model shape).

    ``mg train --nproc-per-node N`` runs it before starting the workers, so a bad config fails
    once, in one line, instead of once per rank.

    Raises:
        TrainingError: naming the key or file at fault.
    """
    dims = check_config(config, env)
    precision = resolve_precision(config)
    from mg_cli.training.metrics import check_log_extras

    check_log_extras(config)
    from mg_data import build_tokenizer

    try:
        tokenizer = build_tokenizer(config.data.tokenizer_model)
    except (ValueError, OSError) as e:
        raise TrainingError(f"data.tokenizer_model: {e}") from None
    from mg_cli.training.build import check_model_layout, model_config
    from mg_cli.training.data import dataset_config, run_datasets, task_labels
    from mg_cli.training.schedule import lr_schedule

    pretrained = None
    if config.checkpoint.init_from is not None:
        from mg_cli.training.pretrained import check_vocabulary, read_pretrained

        pretrained = read_pretrained(config.checkpoint.init_from)
        check_vocabulary(pretrained, tokenizer.vocab_size, config.data.tokenizer_model)
    dataset_config(config, tokenizer, None)  # the family's special tokens and sample lengths
    labels = built = None
    if config.data.format == "classification":  # the head's size is the data's label count: build the data now
        built = run_datasets(config, tokenizer)
        labels = task_labels(built[1])
    model_cfg = model_config(config, tokenizer.vocab_size, pretrained, num_labels=labels[1] if labels else None)
    check_model_layout(model_cfg, config)
    try:
        schedule = lr_schedule(config.optim, config.train.iters)
    except ValueError as e:
        raise TrainingError(str(e)) from None
    from mg_cli.training.tasks import parse_tasks

    return Plan(dims=dims, tokenizer=tokenizer, model_config=model_cfg, schedule=schedule, precision=precision,
                pretrained=pretrained, labels=labels, tasks=parse_tasks(config), datasets=built)


def _resolve_load(config: RunConfig, resume: bool) -> str | None:
    from mg_ckpt import latest_iteration

    c = config.checkpoint
    if c.load is not None:
        return c.load
    if resume and c.save is not None and os.path.isdir(c.save) and latest_iteration(c.save) is not None:
        return c.save
    return None


def _train(config: RunConfig, env: Env, plan: Plan, load_path: str | None, stop: SignalFlag,
           saver: Any) -> dict[str, Any]:
    """Build the run, then iterate: step, log, evaluate, save, and stop when every rank agrees to."""
    from mg_cli.training.metrics import MetricsLogger, report_start, step_record, wandb_init_args
    from mg_cli.training.policy import CheckpointPolicy, StopConditions
    from mg_cli.training.run import build_run
    from mg_cli.training.step import check_loss, evaluate, train_step
    from mg_cli.training.tasks import LoopTasks
    from mg_cli.training.throughput import peak_flops

    run = build_run(config, env, plan, load_path, saver)
    t, start_iter = config.train, run.start_iter
    batches = run.data.train_iterator(start_iter * t.global_batch_size)
    valid = run.data.valid_batches() if config.eval.interval or config.eval.iters else None
    # Per device, fixed for the run: log.peak_tflops, else published for known GPUs, else measured here, before
    # data workers, TensorBoard or W&B start.
    peak = peak_flops(run.precision.compute_dtype, run.grid.device, configured_tflops=config.log.peak_tflops)
    logger = MetricsLogger(config.log.dir, enabled=env.is_main, total_iters=t.iters, start_iter=start_iter,
                           tensorboard=config.log.tensorboard, wandb=wandb_init_args(config) if env.is_main else None)
    report_start(run, logger, peak)
    checkpoints = CheckpointPolicy(run, logger.message)
    stops = StopConditions(stop, run.grid, t.exit_after_minutes)

    tasks = LoopTasks(run, plan.tasks) if plan.tasks else None

    def validate(iteration: int) -> float | None:
        record = {**(evaluate(run, valid) if valid else {}), **(tasks() if tasks else {})}
        if record:
            logger.log({"iteration": iteration, **record})
        return record.get("val_loss")

    last_loss = last_val = None
    iteration = start_iter
    try:
        while iteration < t.iters:
            iteration += 1
            # Only a logged step reads values back from the device (an unlogged one leaves it running ahead).
            result = train_step(run, iteration, batches, log=iteration % config.log.interval == 0
                                or iteration == t.iters)
            if result.logged:
                last_loss = result.loss
                if result.compile_seconds >= 1.0:
                    logger.message(f"iteration {iteration}: {result.compile_seconds:.1f} s compiling (train.compile), "
                                   f"left out of its step time and tokens/s")
                logger.log(step_record(run, result, peak))
            if config.eval.interval and iteration % config.eval.interval == 0:
                last_val = validate(iteration)
            if checkpoints.due(iteration):
                check_loss(run, result)
                checkpoints.save(iteration)
            decision = stops.check()
            if iteration >= t.iters:
                break  # the end-of-run save below
            if decision.request in (STOP, SAVE) or decision.timed_out:
                check_loss(run, result)
                last_loss = result.loss if result.logged else float(result.pending_loss)
            if decision.request == STOP or decision.timed_out:
                path = checkpoints.save(iteration, StopConditions.describe(decision, iteration, t.exit_after_minutes))
                summary = {"iteration": iteration, "loss": last_loss, "val_loss": last_val, "stopped": True}
                return {**summary, "signal": decision.signum, "saved": path} if decision.request == STOP else summary
            if decision.request == SAVE:
                checkpoints.save(iteration, StopConditions.describe(decision, iteration, t.exit_after_minutes))
        if (valid or tasks) and iteration > start_iter and (config.eval.interval == 0
                                                            or iteration % config.eval.interval != 0):
            last_val = validate(iteration)
        if iteration > start_iter:
            checkpoints.save(iteration)
        return {"iteration": iteration, "loss": last_loss, "val_loss": last_val, "stopped": False}
    except BaseException:
        logger.close(failed=True)
        raise
    finally:
        logger.close()
