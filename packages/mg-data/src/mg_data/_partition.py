"""Partitions of a preprocessing run: where each worker writes its partial datasets, the marker that says a
partition is complete, and the per-process state a worker reads (its tokenizer and the job settings)."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["MAX_EXAMPLES", "STATE", "mark_done", "marker_path", "part_prefix", "record_bad"]

MAX_EXAMPLES = 10
"""Bad lines quoted per partition (the rest are only counted)."""

STATE: dict[str, Any] = {}
"""Per-process state of a worker: ``config``, ``tok``, ``parts_dir``, ``dtype``, ``splitter``, ``template``."""


def part_prefix(parts_dir: str, index: int, key: str, level: str) -> str:
    """Path prefix of partition ``index``'s partial dataset of field ``key`` at ``level`` (document/sentence)."""
    return os.path.join(parts_dir, f"part-{index:07d}_{key}_{level}")


def marker_path(parts_dir: str, index: int) -> str:
    """The file whose presence says partition ``index`` is complete (it holds the partition's statistics)."""
    return os.path.join(parts_dir, f"part-{index:07d}.done")


def mark_done(parts_dir: str, index: int, stats: dict[str, Any]) -> dict[str, Any]:
    """Write partition ``index``'s marker atomically; returns ``stats``."""
    marker = marker_path(parts_dir, index)
    with open(marker + ".tmp", "w") as f:
        json.dump(stats, f)
    os.replace(marker + ".tmp", marker)
    return stats


def record_bad(stats: dict[str, Any], rel: int, reason: str, skippable: bool = True) -> bool:
    """Record a bad line; True when the partition must stop (the line is not skipped)."""
    if not (skippable and STATE["config"].skip_bad_lines):
        stats["error"] = (rel, reason)
        return True
    stats["bad_lines"] += 1
    if len(stats["bad"]) < MAX_EXAMPLES:
        stats["bad"].append((rel, reason))
    return False
