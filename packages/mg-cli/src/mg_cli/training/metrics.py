"""Run logging: metrics.jsonl (flushed per line), a progress bar or plain lines, TensorBoard."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Writes one JSON object per logged iteration/eval to ``LOGDIR/metrics.jsonl`` (global rank 0 only).

    Each line is flushed and fsync'ed as it is written, so a crash loses nothing already logged.
    On a terminal a tqdm bar shows iteration, loss, tokens/s and ETA; otherwise plain lines go to
    stdout.
    """

    def __init__(self, log_dir: str | Path, *, enabled: bool, total_iters: int, start_iter: int,
                 tensorboard: bool = False) -> None:
        self.enabled = enabled
        self.path = Path(log_dir) / "metrics.jsonl"
        self._file = None
        self._bar = None
        self._tb = None
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
            except ImportError as e:
                raise RuntimeError(
                    "log.tensorboard is true but TensorBoard is not installed; pip install 'mg-cli[tensorboard]'"
                ) from e
            self._tb = SummaryWriter(str(Path(log_dir) / "tensorboard"))
        self._t0 = time.monotonic()

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` (must hold ``iteration``) and show it."""
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        it = record["iteration"]
        if self._tb is not None:
            for k, v in record.items():
                if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
                    self._tb.add_scalar(k, v, it)
        if self._bar is not None:
            if "loss" in record:
                self._bar.n = it
                self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record.get('tokens_per_s', 0):.0f}")
                self._bar.refresh()
            if "val_loss" in record:
                self._bar.write(f"iteration {it}: validation loss {record['val_loss']:.4f} ppl {record['val_ppl']:.2f}")
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
        """Append ``record`` to metrics.jsonl only (not shown, not in TensorBoard), e.g. the run's settings."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
            self._file = None
