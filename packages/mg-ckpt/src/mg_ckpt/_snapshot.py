"""Copies of the state an asynchronous save writes: staging buffers reused between saves (each
saver owns its own), and the background copy that overlaps the next step's forward and backward
(``background_snapshot``)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

_COPY_CHUNK = 8 << 20  # bytes per unit of work shared between the save thread and a waiting caller


class StagingBuffers:
    """CPU buffers (pinned, for device tensors) of one saver's last asynchronous save, reused by its next.

    Allocating and first-touching (or pinning) a state-sized buffer costs more than the copy
    itself, so a :class:`~mg_ckpt.save.CheckpointSaver` keeps them between saves, keyed by tensor
    name, shape, dtype and device type.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._buffers)

    def get(self, name: str, t: torch.Tensor, keep: bool) -> torch.Tensor:
        """A buffer shaped like ``t`` (the kept one if any; kept for the next save when ``keep``)."""
        key = _key(name, t)
        out = self._buffers.get(key)
        if out is None:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
            if keep:
                self._buffers[key] = out
        return out

    def snapshot(self, name: str, t: torch.Tensor, copy: bool) -> torch.Tensor:
        """``t`` as a contiguous CPU tensor; a copy into a kept buffer when ``copy`` or on a device."""
        t = t.detach()
        if t.device.type == "cpu" and not copy:
            return t if t.is_contiguous() else t.contiguous()
        out = self.get(name, t, keep=copy)
        out.copy_(t, non_blocking=out.is_pinned())
        return out

    def keep_only(self, live: dict[str, torch.Tensor]) -> None:
        """Free the buffers of tensors not in ``live`` (name -> the tensor saved now)."""
        keys = {_key(n, t) for n, t in live.items()}
        for key in [k for k in self._buffers if k not in keys]:
            del self._buffers[key]

    def clear(self) -> None:
        """Free every buffer."""
        self._buffers.clear()


def _key(name: str, t: torch.Tensor) -> tuple:
    return (name, tuple(t.shape), t.dtype, t.device.type)


class _SnapshotCopy:
    """The copies of this rank's pieces into staging memory, done in the background.

    CPU tensors are cut into chunks of ``_COPY_CHUNK`` bytes that the save thread and any caller
    of :meth:`run` take in turn (single-threaded numpy copies, which release the GIL and stay out
    of torch's intra-op pool, busy with the training step). CUDA tensors are copied on a side
    stream that first waits for the work queued before the save call, into pinned memory.
    ``done`` is set when every copy has finished (or failed: ``error``).
    """

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._chunks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._device: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._stream: Any = None
        for dst, src in pairs:
            if src.device.type == "cpu":
                self._chunks += _chunked(dst, src)
            else:
                self._device.append((dst, src))
        if self._device:  # CUDA only: save_checkpoint refused other devices on every rank
            self._stream = torch.cuda.Stream(device=self._device[0][1].device)
            self._stream.wait_stream(torch.cuda.current_stream(self._device[0][1].device))
            for _, src in self._device:
                src.record_stream(self._stream)  # the allocator must not reuse it before the copy ran
        self._next = 0
        self._left = len(self._chunks) + (1 if self._device else 0)
        if not self._left:
            self.done.set()

    def _finished(self, error: BaseException | None) -> None:
        with self._lock:
            self.error = self.error or error
            self._left -= 1
            if self._left == 0:
                self.done.set()

    def release(self) -> None:
        """Drop the references to the caller's tensors (once ``done``)."""
        with self._lock:
            self._next = 0
            self._chunks, self._device = [], []

    def run_device(self) -> None:
        """Issue the accelerator copies on the side stream and wait for them (the save thread only)."""
        if not self._device:
            return
        error = None
        try:
            with torch.cuda.stream(self._stream):
                for dst, src in self._device:
                    dst.copy_(src, non_blocking=True)
            self._stream.synchronize()
        except BaseException as e:
            error = e
        self._finished(error)

    def run(self) -> None:
        """Copy CPU chunks until none is left to take (others may still be in progress)."""
        while True:
            with self._lock:
                if self._next >= len(self._chunks):
                    return
                dst, src = self._chunks[self._next]
                self._next += 1
            error = None
            try:
                if dst.dtype == src.dtype and src.is_contiguous():
                    np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
                else:
                    dst.copy_(src)
            except BaseException as e:
                error = e
            self._finished(error)


def _chunked(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if not src.is_contiguous() or src.numel() == 0:
        return [(dst, src)]
    d, s = dst.view(-1), src.view(-1)
    step = max(1, _COPY_CHUNK // src.element_size())
    return [(d[i : i + step], s[i : i + step]) for i in range(0, s.numel(), step)]
