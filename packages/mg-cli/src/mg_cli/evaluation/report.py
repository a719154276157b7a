"""What ``mg eval`` shows and writes: a progress bar per task, a results table, a JSON report."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["format_table", "progress_bar", "silent_progress", "write_json"]


@contextmanager
def progress_bar(desc: str, total: int) -> Iterator[Callable[[int], None]]:
    """Yield ``update(n)``: a tqdm bar on a terminal, otherwise a line on stderr every 10 s (and at the end
    of runs that took that long)."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        with tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, leave=False) as bar:
            yield bar.update
        return
    start = last = time.monotonic()
    done = [0]

    def update(n: int) -> None:
        nonlocal last
        done[0] += n
        now = time.monotonic()
        if now - last > 10:
            last = now
            print(f"mg eval: {desc}: {done[0]}/{total} requests, {done[0] / (now - start):.1f}/s",
                  file=sys.stderr, flush=True)

    yield update
    if time.monotonic() - start > 10:
        print(f"mg eval: {desc}: {done[0]}/{total} requests in {time.monotonic() - start:.0f} s",
              file=sys.stderr, flush=True)


@contextmanager
def silent_progress(desc: str, total: int) -> Iterator[Callable[[int], None]]:
    """A progress context that shows nothing (ranks other than 0)."""
    yield lambda n: None


def _fmt(x: float | None) -> str:
    if x is None:
        return ""
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    return f"{x:.4f}" if abs(x) < 1e5 else f"{x:.4g}"


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """One row per task and metric: task, metric, value, ± standard error, examples."""
    rows = [("task", "metric", "value", "± stderr", "n")]
    for r in results:
        for i, (name, m) in enumerate(r["metrics"].items()):
            rows.append((r["task"] if i == 0 else "", name, _fmt(m["value"]),
                         _fmt(m.get("stderr")), str(r["num_examples"]) if i == 0 else ""))
    widths = [max(len(row[c]) for row in rows) for c in range(5)]
    lines = []
    for j, row in enumerate(rows):
        cells = [row[c].ljust(widths[c]) if c < 2 else row[c].rjust(widths[c]) for c in range(5)]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | os.PathLike[str], report: dict[str, Any]) -> None:
    """Write ``report`` as indented JSON, atomically (a temporary file renamed into place)."""
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
