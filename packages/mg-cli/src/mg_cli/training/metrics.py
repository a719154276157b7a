"""Run logging: metrics.jsonl (flushed per line), a progress bar or plain lines, TensorBoard, Weights & Biases."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from mg_cli.training.setup import TrainingError


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of ``record`` that TensorBoard and W&B plot: every int or float but ``iteration`` (not bools)."""
    return {k: v for k, v in record.items()
            if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def check_log_extras(config: Any) -> None:
    """The packages that ``config.log`` asks for are installed (checked before the run is built).

    Raises:
        TrainingError: naming the key and the mg-cli extra to install.
    """
    if config.log.tensorboard and find_spec("tensorboard") is None:
        raise TrainingError("log.tensorboard is true but TensorBoard is not installed; pip install 'mg-cli[tensorboard]'")
    if config.log.wandb_project is not None and find_spec("wandb") is None:
        raise TrainingError("log.wandb_project is set but wandb is not installed; pip install 'mg-cli[wandb]'")


def wandb_init_args(config: Any) -> dict[str, Any] | None:
    """``wandb.init`` keyword arguments for a run configured with ``log.wandb_project`` (None without it): the
    project, entity, run name and mode of the ``log`` section, the resolved config, and ``dir`` LOGDIR unless
    ``WANDB_DIR`` says otherwise."""
    log = config.log
    if log.wandb_project is None:
        return None
    args: dict[str, Any] = {"project": log.wandb_project, "entity": log.wandb_entity, "name": log.wandb_run_name,
                            "mode": log.wandb_mode, "config": config.to_dict()}
    if not os.environ.get("WANDB_DIR"):
        args["dir"] = log.dir
    return args


class MetricsLogger:
    """Writes one JSON object per logged iteration/eval to ``LOGDIR/metrics.jsonl`` (global rank 0 only).

    Each line is flushed and fsync'ed as it is written, so a crash loses nothing already logged.
    On a terminal a tqdm bar shows iteration, loss, tokens/s and ETA; otherwise plain lines go to
    stdout. The numbers of each logged record also go to TensorBoard and to a Weights & Biases run when
    asked for, at step = iteration.
    """

    def __init__(self, log_dir: str | Path, *, enabled: bool, total_iters: int, start_iter: int,
                 tensorboard: bool = False, wandb: dict[str, Any] | None = None) -> None:
        """Open the log of rank 0 (``enabled``); other ranks get a logger that does nothing.

        Args:
            log_dir: LOGDIR (created).
            enabled: whether this process logs (global rank 0).
            total_iters, start_iter: the progress bar's length and start.
            tensorboard: write TensorBoard scalars under LOGDIR/tensorboard.
            wandb: ``wandb.init`` keyword arguments (:func:`wandb_init_args`); None: no W&B run.

        Raises:
            TrainingError: TensorBoard or wandb asked for but not installed, or ``wandb.init`` failed (one line).
        """
        self.enabled = enabled
        self.path = Path(log_dir) / "metrics.jsonl"
        self._file = None
        self._bar = None
        self._tb = None
        self._wandb = None
        self._mfu_warned = False
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        if sys.stdout.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_iters, initial=start_iter, unit="it", dynamic_ncols=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise TrainingError("log.tensorboard is true but TensorBoard is not installed; "
                                    "pip install 'mg-cli[tensorboard]'") from None
            self._tb = SummaryWriter(str(Path(log_dir) / "tensorboard"))
        if wandb is not None:
            try:
                self._wandb = _start_wandb(wandb)
            except TrainingError:
                self.close()
                raise
        self._t0 = time.monotonic()

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` (must hold ``iteration``) and show it; its numbers go to TensorBoard and W&B. The
        first record with an ``mfu_note`` also prints that note as a warning line."""
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        it = record["iteration"]
        scalars = _scalars(record)
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, it)
        if self._wandb is not None and scalars:
            self._wandb.log(scalars, step=it)
        if record.get("mfu_note") and not self._mfu_warned:
            self._mfu_warned = True
            self.message(f"warning: iteration {it}: {record['mfu_note']} (each such step has this mfu_note in "
                         f"metrics.jsonl)")
        if self._bar is not None:
            if "loss" in record:
                self._bar.n = it
                self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record.get('tokens_per_s', 0):.0f}")
                self._bar.refresh()
            if "val_loss" in record:
                ppl = f" ppl {record['val_ppl']:.2f}" if "val_ppl" in record else ""
                self._bar.write(f"iteration {it}: validation loss {record['val_loss']:.4f}{ppl}")
        else:
            parts = [f"iteration {it}"]
            for k in ("loss", "lm_loss", "sop_loss", "nsp_loss", "val_loss", "val_ppl", "lr", "grad_norm",
                      "tokens_per_s", "mfu"):
                if k in record and record[k] is not None:
                    v = record[k]
                    parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
            if record.get("skipped"):
                parts.append("skipped (fp16 overflow)")
            print(" | ".join(parts), flush=True)

    def record(self, record: dict[str, Any]) -> None:
        """Append ``record`` to metrics.jsonl only (not shown, not in TensorBoard), e.g. the run's settings. The
        run's start record (``event: start``) also goes into the W&B run's config, under ``start``."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._wandb is not None and record.get("event") == "start":
            self._wandb.config.update({"start": {k: v for k, v in record.items() if k not in ("iteration", "event")}},
                                      allow_val_change=True)

    def message(self, text: str) -> None:
        """Show one line (above the progress bar on a terminal); rank 0 only."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self, *, failed: bool = False) -> None:
        """Close the bar, TensorBoard, the W&B run (exit code 1 when ``failed``) and metrics.jsonl; a second call
        does nothing."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            run, self._wandb = self._wandb, None
            run.finish(exit_code=1 if failed else 0)
        if self._file is not None:
            self._file.close()
            self._file = None


def _start_wandb(init_args: dict[str, Any]) -> Any:
    """``wandb.init(**init_args)``; its failures (no API key online, a bad entity, ...) as one line."""
    try:
        import wandb
    except ImportError:
        raise TrainingError("log.wandb_project is set but wandb is not installed; pip install 'mg-cli[wandb]'") \
            from None
    try:
        return wandb.init(**init_args)
    except Exception as e:  # noqa: BLE001 - wandb raises many kinds (UsageError, CommError, ...)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TrainingError(f"log.wandb_project: wandb.init failed: {first} (log.wandb_mode=offline logs without an "
                            f"account; `wandb sync` uploads later)") from None


def effective_settings(run: Any) -> dict[str, Any]:
    """The settings that change execution, as the built grid, model chunks, optimizer and schedule have them.

    Keys: tp, pp, dp, vpp (model chunks on this rank), sequence_parallel, distributed_optimizer,
    recompute ("none", "full" or "full:<k> layers"), precision (of the model parameters),
    micro_batches (per optimizer step and data-parallel rank) and schedule (the pipeline schedule:
    no_pipelining, 1f1b or interleaved); with context parallelism (cp > 1) also cp and cp_comm, as the
    model's attention runs them; with fully sharded data parallelism also fsdp, fsdp_shard_size (the ranks each
    parameter is split over) and offload_optimizer, as the sharded chunks have them; for a mixture-of-experts
    model also ep, etp and experts (the expert computation path of this rank's MoE layers); with
    ``train.compile`` also compiled_layers (this rank's layers that run compiled).
    """
    from mg_models.compilation import compiled_layers

    inner = [getattr(chunk, "module", chunk) for chunk in run.model]
    ctx = inner[0].ctx
    rc = ctx.recompute
    recompute = "none"
    if rc is not None and rc.granularity is not None:
        recompute = rc.granularity + (f":{rc.num_layers} layers" if rc.num_layers is not None else "")
    fsdp = run.model[0] if getattr(run.model[0], "fully_sharded", False) else None
    # The policy's name when the built parameters are in its dtype (FSDP: fp32 shards, gathered in the policy's
    # compute dtype), else the dtype they really have.
    policy = fsdp.precision if fsdp is not None else run.precision
    dtype = next(inner[0].parameters()).dtype
    precision = policy.name if dtype == (policy.main_param_dtype if fsdp else policy.param_dtype) else str(dtype)
    grid = run.grid
    return {
        "tp": grid.tp_size, "pp": grid.pp_size, "dp": grid.dp_size, "vpp": len(inner),
        "sequence_parallel": bool(ctx.sequence_parallel), "distributed_optimizer": bool(run.optimizer.distributed),
        "recompute": recompute, "precision": precision, "micro_batches": run.num_micro,
        "schedule": run.forward_backward.__name__.removeprefix("forward_backward_"),
        **({"cp": ctx.cp_size, "cp_comm": ctx.cp_comm} if ctx.cp_size > 1 else {}),
        **({"fsdp": True, "fsdp_shard_size": fsdp.shard_size, "offload_optimizer": fsdp.offload} if fsdp else {}),
        **_expert_settings(run, inner),
        **({"compiled_layers": sum(compiled_layers(chunk) for chunk in inner)} if run.config.train.compile else {}),
    }


_SDPA_KERNELS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}


def fast_paths(run: Any) -> dict[str, str]:
    """The kernels this run's step picks on its device: ``adamw`` (fused or foreach), ``attention`` (the
    ``scaled_dot_product_attention`` kernel torch chooses for this model's head size, dtype, mask and dropout;
    context parallelism names its comm and block kernel), ``norm`` and ``compile``; with data or context
    parallelism under DDP also ``grad_reduce`` (bucket reductions overlapped with backward, or after it) and,
    with the distributed optimizer, ``param_gather`` (overlapped with the next forward, or after the step)."""
    import torch

    from mg_models.compilation import compiled_layers
    from mg_models.family import get_family
    from mg_parallel.optimizer.adamw import fused_adamw_supported

    cfg, config, device = run.model_config, run.config, run.grid.device
    inner = [getattr(chunk, "module", chunk) for chunk in run.model]
    main_dtype = torch.float32
    paths = {"adamw": "fused" if fused_adamw_supported(device, main_dtype) else "foreach"}
    heads = (getattr(cfg, "head_dim", None) or getattr(cfg, "kv_channels", None)
             or cfg.hidden_size // cfg.num_attention_heads)
    if run.grid.cp_size > 1:  # the blocks' kernel (a2a runs SDPA on the whole sequence of its heads)
        from mg_parallel.context_parallel import block_attention_impl

        dtype = run.precision.compute_dtype
        kernel = "sdpa" if config.parallel.cp_comm == "a2a" else block_attention_impl(device, dtype, "causal", heads)
        paths["attention"] = f"context_parallel:{config.parallel.cp_comm}:{kernel}"
    else:
        q = torch.zeros(1, 1, 8, heads, dtype=run.precision.compute_dtype, device=device)
        causal = get_family(config.model.type).kind == "decoder"
        plain = causal and config.data.format == "pretrain" and not getattr(cfg, "sliding_window", None)
        mask = None if plain else torch.ones(8, 8, dtype=torch.bool, device=device)
        dropout = float(getattr(cfg, "attention_dropout", None) or getattr(cfg, "dropout", 0.0) or 0.0)
        choice = int(torch._fused_sdp_choice(q, q, q, mask, dropout, plain))
        paths["attention"] = "sdpa:" + _SDPA_KERNELS.get(choice, str(choice))
    norm = cfg.normalization
    paths["norm"] = ("F.rms_norm" if device.type == "cuda" else "composite") if norm == "rmsnorm" else "F.layer_norm"
    compiled = sum(compiled_layers(chunk) for chunk in inner)
    paths["compile"] = f"{compiled} layers" if compiled else "off"
    chunk = run.model[0]
    if run.grid.dp_size * run.grid.cp_size > 1 and hasattr(chunk, "overlap_grad_reduce"):  # mg's DDP
        paths["grad_reduce"] = "overlapped" if chunk.overlap_grad_reduce else "after_backward"
        if run.optimizer.distributed:
            overlap = getattr(getattr(run.optimizer, "config", None), "overlap_param_gather", False)
            paths["param_gather"] = "overlapped" if overlap else "after_step"
    return paths


def _expert_settings(run: Any, inner: list[Any]) -> dict[str, Any]:
    """MoE models: ep, etp and how this rank computes its experts (``grouped_mm`` or ``loop``; ``none`` on a
    pipeline stage without MoE layers)."""
    from mg_parallel.moe import GroupedExperts

    if not getattr(run.model_config, "is_moe", False):
        return {}
    paths = {m.path for chunk in inner for m in chunk.modules() if isinstance(m, GroupedExperts)}
    return {"ep": run.grid.ep_size, "etp": run.grid.etp_size, "experts": ",".join(sorted(paths)) or "none"}


def report_start(run: Any, logger: MetricsLogger, peak: Any) -> None:
    """Rank 0: ``LOGDIR/config.yaml``, the start line naming the effective settings, a note when the precision's
    matmuls are slower than fp32's here, the resolved config, and the first metrics.jsonl record."""
    from mg_cli.training.throughput import slower_than_fp32_note

    if not run.env.is_main:
        return
    config = run.config
    os.makedirs(config.log.dir, exist_ok=True)
    with open(os.path.join(config.log.dir, "config.yaml"), "w") as f:
        f.write(config.to_yaml())
    # What the run really does, read from the objects built (an option that was ignored shows here).
    settings = effective_settings(run)
    logger.message(f"mg train: {run.env.world_size} processes, "
                   + " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items())
                   + (f", resuming at iteration {run.start_iter + 1}" if run.start_iter else ""))
    paths = fast_paths(run)
    logger.message("paths: " + " ".join(f"{k}={v}" for k, v in paths.items()))
    if run.grid.device.type == "cuda" and paths.get("attention") == "sdpa:math":
        logger.message("attention runs torch's math kernel (this mask with dropout, or a head size the fused "
                       "kernels do not take): slower, and memory quadratic in the sequence length")
    if run.init_report is not None:
        logger.message(run.init_report)
    slower = slower_than_fp32_note(run.precision, run.grid.device)
    if slower:
        logger.message(slower)
    logger.message("resolved config:\n" + config.to_yaml().rstrip())
    logger.record({"iteration": run.start_iter, "event": "start", "processes": run.env.world_size,
                   "settings": settings, "paths": paths, "mfu_peak_tflops_per_device": peak.flops_per_s / 1e12,
                   "mfu_peak_source": peak.source})


def step_record(run: Any, result: Any, peak: Any) -> dict[str, Any]:
    """The metrics.jsonl record of one training step (see the mg-cli README for the keys).

    ``tflops_per_device`` = FLOPs per token x ``tokens_per_s`` / processes; ``mfu`` = that over ``peak``
    (a :class:`~mg_cli.training.throughput.PeakFlops`, fixed for the run), not capped. A step above the peak
    gets ``mfu_note``, the one line saying what that means for the peak's source.
    """
    t = run.config.train
    tokens_per_s = t.global_batch_size * run.config.model.seq_length / result.seconds
    flops_per_device = run.flops_per_token * tokens_per_s / run.grid.world_size
    note = peak.excess_note(flops_per_device)
    return {
        "iteration": result.iteration, "loss": result.loss, **result.parts, "lr": result.lr,
        "grad_norm": result.grad_norm, "tokens_per_s": tokens_per_s, "mfu": peak.utilization(flops_per_device),
        **({"mfu_note": note} if note else {}),
        "tflops_per_device": flops_per_device / 1e12, "step_time_s": result.seconds,
        "peak_mem_bytes": peak_memory_bytes(run.grid.device), "skipped": not result.applied,
        "loss_scale": float(run.optimizer.loss_scale) if run.precision.needs_loss_scaling else None,
        **({"compile_s": result.compile_seconds} if result.compile_seconds else {}),
    }


def peak_memory_bytes(device: Any) -> int:
    """Peak memory of this process: allocated CUDA memory, or the peak resident set size on CPU."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return 0
