"""Progress display for long library calls: a tqdm bar on a terminal, periodic lines otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def preprocess_progress() -> Iterator[Callable[[Any], None]]:
    """Yield a callback for ``mg_data.run_preprocess`` showing MB done, MB/s and docs/s."""
    bar = None
    last = [0.0]
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(unit="MB", unit_scale=False, dynamic_ncols=True, bar_format="{l_bar}{bar}| {n:.1f}/{total_fmt} MB "
                   "[{elapsed}<{remaining}, {postfix}]")

    def update(info: Any) -> None:
        if bar is not None:
            if info.total_bytes and bar.total is None:
                bar.total = info.total_bytes / 1e6
            bar.n = info.bytes / 1e6
            bar.set_postfix_str(f"{info.mb_per_s:.2f} MB/s, {info.docs_per_s:.0f} docs/s, "
                                f"partitions {info.partitions_done}/{info.partitions_total or '?'}")
        elif time.monotonic() - last[0] > 10:
            last[0] = time.monotonic()
            print(f"preprocess: {info.bytes / 1e6:.1f} MB, {info.mb_per_s:.2f} MB/s, {info.docs_per_s:.0f} docs/s, "
                  f"partitions {info.partitions_done}/{info.partitions_total or '?'}", file=sys.stderr, flush=True)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()
