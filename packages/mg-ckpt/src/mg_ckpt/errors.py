"""The one exception type of mg-ckpt."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the directory, file or tensor at fault."""
