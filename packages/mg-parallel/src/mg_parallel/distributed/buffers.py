"""Contiguous gradient (and parameter) buffers split into buckets.

Every trainable parameter of a model gets ``param.main_grad``, a view into one flat buffer per
(parameter dtype, gradient dtype) pair. Parameters are laid out in *reverse* registration order,
which is roughly the order in which backward produces their gradients, so the first bucket fills
first and its communication can start while backward is still running.

With the distributed optimizer each bucket is padded to a multiple of ``shard_multiple`` (a
multiple of the data-parallel size) so that it splits into equal contiguous shards, one per
data-parallel rank: rank ``r`` owns ``bucket[r * n / dp : (r + 1) * n / dp]``. Parameters may
straddle shard boundaries; the optimizer works on the pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mg_parallel.tags import is_pipeline_replicated, is_shared_embedding

__all__ = ["Bucket", "GradBuffer", "ParamSlot"]


@dataclass
class ParamSlot:
    """Where one parameter lives in its buffer: ``[start, end)`` in buffer elements."""

    param: torch.nn.Parameter
    start: int
    end: int
    bucket: int


@dataclass
class Bucket:
    """A contiguous range of a :class:`GradBuffer` reduced by one collective."""

    index: int
    start: int
    """First buffer element of this bucket."""
    end: int
    """One past the last buffer element (padding included)."""
    params: list[torch.nn.Parameter]
    grad_data: torch.Tensor
    """View of the buffer's gradients for this bucket (``end - start`` elements)."""
    param_data: torch.Tensor | None = None
    """View of the contiguous parameter storage (distributed optimizer only), for all-gather."""
    ready: set[int] = field(default_factory=set)
    """ids of params whose gradient for this backward has been accumulated."""
    handle: dist.Work | None = None
    launched: bool = False
    """True once this bucket's reduction has been issued in the current iteration."""
    gather_handle: dist.Work | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class GradBuffer:
    """One flat gradient buffer for all parameters of one dtype, cut into buckets.

    Args:
        params: parameters (all of ``param_dtype``), in registration order.
        grad_dtype: dtype of the gradient buffer (fp32 for fp32 accumulation of bf16 grads).
        bucket_numel: a bucket is closed once it holds at least this many elements.
        shard_multiple: every bucket's size is padded to a multiple of this (1 = no padding).
        contiguous_params: also move the parameters' data into one flat buffer with the same
            layout (needed to all-gather updated shards with one collective per bucket).
        device: where the buffers live.
        per_bucket_storage: give each bucket its own gradient storage (ZeRO-2), so a bucket's
            full gradient can be released after its reduce-scatter and re-allocated on demand.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        *,
        grad_dtype: torch.dtype,
        bucket_numel: int,
        shard_multiple: int,
        contiguous_params: bool,
        device: torch.device,
        per_bucket_storage: bool = False,
    ) -> None:
        if not params:
            raise ValueError("GradBuffer needs at least one parameter")
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype
        self.shard_multiple = shard_multiple
        # Lay out in reverse registration order (~ backward order); a tied/shared embedding (and a
        # parameter every pipeline stage holds) gets a bucket of its own so that pipeline stages with
        # different layouts agree on its shards.
        layout: list[tuple[list[torch.nn.Parameter], int, int]] = []  # (params, start, padded end)
        current: list[torch.nn.Parameter] = []
        offset = bucket_start = 0
        slots: list[tuple[torch.nn.Parameter, int, int]] = []

        def close() -> None:
            nonlocal current, offset, bucket_start
            if not current:
                return
            end = bucket_start + _round_up(offset - bucket_start, shard_multiple)
            layout.append((current, bucket_start, end))
            current, offset, bucket_start = [], end, end

        for p in reversed(params):
            shared = is_shared_embedding(p) or is_pipeline_replicated(p)
            if shared:
                close()
            slots.append((p, offset, offset + p.numel()))
            current.append(p)
            offset += p.numel()
            if shared or offset - bucket_start >= bucket_numel:
                close()
        close()
        self.numel = offset
        self.per_bucket_storage = per_bucket_storage
        self.grad_data: torch.Tensor | None = None
        if not per_bucket_storage:
            self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data: torch.Tensor | None = None
        if contiguous_params:
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
        self.buckets: list[Bucket] = []
        for i, (ps, start, end) in enumerate(layout):
            self.buckets.append(
                Bucket(
                    index=i, start=start, end=end, params=ps,
                    grad_data=(
                        torch.zeros(end - start, dtype=grad_dtype, device=device)
                        if self.grad_data is None else self.grad_data[start:end]
                    ),
                    param_data=None if self.param_data is None else self.param_data[start:end],
                )
            )
        self.slots: dict[int, ParamSlot] = {}
        bucket_of = {id(p): b.index for b in self.buckets for p in b.params}
        for p, start, end in slots:
            b = self.buckets[bucket_of[id(p)]]
            self.slots[id(p)] = ParamSlot(p, start, end, b.index)
            p.main_grad = b.grad_data[start - b.start : end - b.start].view(p.shape)  # type: ignore[attr-defined]
            if self.param_data is not None:
                # Parameters become views of the flat buffer so a shard all-gather updates them.
                view = self.param_data[start:end].view(p.shape)
                view.copy_(p.data)
                p.data = view

    def bucket_of(self, param: torch.nn.Parameter) -> Bucket:
        """The bucket holding ``param``."""
        return self.buckets[self.slots[id(param)].bucket]

    def zero(self) -> None:
        """Zero every gradient and forget readiness (start of a new iteration)."""
        if self.grad_data is not None:
            self.grad_data.zero_()
        for b in self.buckets:
            if self.per_bucket_storage:
                release_bucket(b)
            b.ready.clear()
            b.launched = False
            b.handle = None


def release_bucket(bucket: Bucket) -> None:
    """Free a bucket's full gradient storage (ZeRO-2); views such as ``main_grad`` stay valid
    objects and become usable again after :func:`ensure_bucket`."""
    storage = bucket.grad_data.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def ensure_bucket(bucket: Bucket) -> None:
    """Re-allocate (zeroed) a bucket's gradient storage released by :func:`release_bucket`."""
    storage = bucket.grad_data.untyped_storage()
    nbytes = bucket.numel * bucket.grad_data.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)
        bucket.grad_data.zero_()
