"""Data parallelism with bucketed gradient reduction overlapped with backward.

Gradients are accumulated into contiguous buffers (``param.main_grad``); as soon as every
gradient of a bucket is ready during the last micro-batch's backward, the bucket's all-reduce (or
reduce-scatter, for the distributed optimizer) is issued asynchronously over the data-parallel
group, so communication of late layers overlaps with backward through early layers.
:meth:`DistributedDataParallel.finish_grad_sync` waits for all of them before the optimizer step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mg_parallel.collectives import all_gather_into_tensor, reduce_scatter_tensor
from mg_parallel.distributed.buffers import Bucket, GradBuffer, ensure_bucket, release_bucket
from mg_parallel.grid import ProcessGrid
from mg_parallel.precision import Precision
from mg_parallel.tags import is_expert_parallel
from mg_parallel.tensor_parallel.utils import group_rank, group_size

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` for data parallelism over ``grid.dp_cp_group``.

    With expert parallelism (``grid.ep_size > 1``) the parameters tagged ``expert_parallel`` get buffers
    of their own, reduced (and sharded by the distributed optimizer) over ``grid.expert_dp_group``.

    Args:
        module: the model (chunk); its parameters keep their dtype (bf16/fp16/fp32).
        grid: the process grid.
        bucket_size_mb: target bucket size in MiB of gradient storage; parameters are never
            split across buckets, so a bucket may be larger than this.
        overlap_grad_reduce: issue each bucket's reduction from backward hooks as soon as its
            gradients are ready; when False, everything is reduced in :meth:`finish_grad_sync`.
        grad_reduce_in_fp32: keep (and reduce) gradients in fp32 even for bf16/fp16 params.
            Default: as ``precision`` says (fp32 when its ``grad_reduce_dtype`` is fp32), or
            False without one.
        use_distributed_optimizer: reduce-scatter instead of all-reduce; buckets are padded to a
            multiple of the data-parallel size and parameters live in a contiguous buffer so the
            optimizer can all-gather its updated shards.
        zero_stage: 1 or 2 (only with the distributed optimizer). Stage 2 gives every bucket its
            own gradient storage, allocated when its first gradient arrives and released after
            the optimizer has consumed its shard (:meth:`release_grad_buffers`).
        precision: the :class:`~mg_parallel.precision.Precision` (or its name) the model trains
            with; it decides the gradient-buffer dtype unless ``grad_reduce_in_fp32`` is given.

    Raises:
        ValueError: a bad option value, an unknown precision name, or ``grad_reduce_in_fp32``
            contradicting ``precision``.
    """

    def __init__(
        self,
        module: nn.Module,
        grid: ProcessGrid,
        *,
        bucket_size_mb: float = 40.0,
        overlap_grad_reduce: bool = True,
        grad_reduce_in_fp32: bool | None = None,
        use_distributed_optimizer: bool = False,
        zero_stage: int = 1,
        precision: Precision | str | None = None,
    ) -> None:
        super().__init__()
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb}")
        if zero_stage not in (1, 2):
            raise ValueError(f"zero_stage must be 1 or 2, got {zero_stage}")
        if zero_stage == 2 and not use_distributed_optimizer:
            raise ValueError("zero_stage=2 needs use_distributed_optimizer=True (gradients are sharded by it)")
        self.precision = None if precision is None else Precision.resolve(precision)
        if self.precision is not None:
            fp32_from_precision = self.precision.grad_reduce_dtype == torch.float32
            if grad_reduce_in_fp32 is not None and grad_reduce_in_fp32 != fp32_from_precision:
                raise ValueError(
                    f"grad_reduce_in_fp32={grad_reduce_in_fp32} contradicts precision={self.precision.name!r}, whose "
                    f"gradients are reduced in {self.precision.grad_reduce_dtype}; pass only precision"
                )
            grad_reduce_in_fp32 = fp32_from_precision
        grad_reduce_in_fp32 = bool(grad_reduce_in_fp32)
        self.module = module
        self.grid = grid
        self.overlap_grad_reduce = overlap_grad_reduce
        self.grad_reduce_in_fp32 = grad_reduce_in_fp32
        self.use_distributed_optimizer = use_distributed_optimizer
        self.zero_stage = zero_stage
        self.dp_group = grid.dp_cp_group
        self.dp_size = group_size(self.dp_group)
        self.dp_rank = group_rank(self.dp_group)
        self._sync_enabled = True
        # Expert weights (split over the ep group) are reduced over the ranks holding the same experts, in
        # buffers of their own; with ep = 1 that group is dp x cp itself and they are ordinary parameters.
        experts = getattr(grid, "ep_size", 1) > 1
        self._comms = {False: _Comm(self.dp_group, self.dp_size)}
        if experts:
            self._comms[True] = _Comm(grid.expert_dp_group, self.dp_size)
        by_kind: dict[tuple[bool, torch.dtype], list[nn.Parameter]] = {}
        seen: set[int] = set()
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                by_kind.setdefault((experts and is_expert_parallel(p), p.dtype), []).append(p)
        device = next(iter(module.parameters())).device if seen else grid.device
        self.buffers: list[GradBuffer] = []
        self._comm_of: dict[int, _Comm] = {}  # id(bucket) -> the group it is reduced over
        for (expert, dtype), params in sorted(by_kind.items(), key=lambda kv: kv[0][0]):  # dense buffers first
            comm = self._comms[expert]
            grad_dtype = torch.float32 if grad_reduce_in_fp32 else dtype
            elem = torch.empty((), dtype=grad_dtype).element_size()
            buf = GradBuffer(
                params, grad_dtype=grad_dtype, bucket_numel=max(1, int(bucket_size_mb * 2**20 / elem)),
                # Padding keeps every shard the same size and reasonably aligned.
                shard_multiple=math.lcm(comm.size, 64) if use_distributed_optimizer else 1,
                contiguous_params=use_distributed_optimizer, device=device, per_bucket_storage=zero_stage == 2,
            )
            self.buffers.append(buf)
            self._comm_of.update({id(b): comm for b in buf.buckets})
        # A global order of buckets (buffer by buffer) so every rank issues collectives identically.
        self.buckets: list[Bucket] = [b for buf in self.buffers for b in buf.buckets]
        self._bucket_of: dict[int, int] = {}
        for gi, b in enumerate(self.buckets):
            for p in b.params:
                self._bucket_of[id(p)] = gi
        self._next_to_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.parameters_with_grad()]
        if use_distributed_optimizer:
            # With overlapped param all-gather, a module waits for its own parameters' buckets
            # just before its forward runs.
            for m in module.modules():
                own = [self._bucket_of[id(p)] for p in m.parameters(recurse=False) if id(p) in self._bucket_of]
                if own:
                    self._hooks.append(m.register_forward_pre_hook(self._make_gather_wait(sorted(set(own)))))

    def _make_gather_wait(self, bucket_ids: list[int]) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            for i in bucket_ids:
                b = self.buckets[i]
                if b.gather_handle is not None:
                    b.gather_handle.wait()
                    b.gather_handle = None

        return hook

    # ---------------------------------------------------------------- pass-through
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Forward to the wrapped module's ``set_input_tensor`` (pipeline stages)."""
        self.module.set_input_tensor(tensor)  # type: ignore[operator]

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped module's state dict (no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load into the wrapped module (keys without the ``module.`` prefix)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def parameters_with_grad(self) -> Iterator[nn.Parameter]:
        """Every trainable parameter, each once, in buffer order."""
        for b in self.buckets:
            yield from b.params

    # ---------------------------------------------------------------- gradient flow
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without communicating (all micro-batches but the last)."""
        old, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = old

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        gi = self._bucket_of[id(param)]
        bucket = self.buckets[gi]
        if self.zero_stage == 2:
            ensure_bucket(bucket)
        if param.grad is not None:
            param.main_grad.add_(param.grad)  # type: ignore[attr-defined]
            param.grad = None
        if not (self._sync_enabled and self.overlap_grad_reduce):
            return
        if id(param) in bucket.ready:
            raise RuntimeError(
                "a parameter's gradient arrived twice in one backward with overlap_grad_reduce=True; "
                "use no_sync() for all but the last micro-batch, or call finish_grad_sync() between backwards"
            )
        bucket.ready.add(id(param))
        # Launch strictly in bucket order so every rank issues the same sequence of collectives.
        while self._next_to_launch < len(self.buckets):
            nxt = self.buckets[self._next_to_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt, async_op=True)
            self._next_to_launch += 1

    def _launch(self, bucket: Bucket, *, async_op: bool) -> None:
        if self.zero_stage == 2:
            ensure_bucket(bucket)
        bucket.launched = True
        comm = self._comm_of[id(bucket)]
        if comm.divisor > 1:
            # Pre-divide so the sum is the average (and bf16 sums stay in range).
            bucket.grad_data.mul_(1.0 / comm.divisor)
        if comm.size == 1:
            return
        if self.use_distributed_optimizer:
            n = bucket.numel // comm.size
            shard = bucket.grad_data[comm.rank * n : (comm.rank + 1) * n]
            bucket.handle = reduce_scatter_tensor(shard, bucket.grad_data, group=comm.group, async_op=async_op)
        else:
            bucket.handle = dist.all_reduce(bucket.grad_data, group=comm.group, async_op=async_op)

    def finish_grad_sync(self) -> None:
        """Issue any bucket not yet reduced and wait for all; after this every ``main_grad`` (or,
        with the distributed optimizer, this rank's shard of every bucket) holds the dp average."""
        self.finish_param_sync()
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket, async_op=False)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
            bucket.ready.clear()
            bucket.launched = False
        self._next_to_launch = 0

    def start_param_sync(self, *, overlap: bool) -> None:
        """Distributed optimizer: all-gather every bucket's updated parameter shards over the dp
        group. With ``overlap`` the gathers run asynchronously and each module waits for its own
        buckets in its next forward (code that reads parameters outside a forward, e.g. saving a
        checkpoint, must call :meth:`finish_param_sync` first)."""
        if not self.use_distributed_optimizer:
            return
        for b in self.buckets:
            comm = self._comm_of[id(b)]
            if comm.size == 1:
                continue
            lo, hi = self.local_shard(b)
            assert b.param_data is not None
            b.gather_handle = all_gather_into_tensor(b.param_data, b.param_data[lo:hi], group=comm.group, async_op=True)
        if not overlap:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every outstanding parameter all-gather."""
        for b in self.buckets:
            if b.gather_handle is not None:
                b.gather_handle.wait()
                b.gather_handle = None

    def zero_grad_buffer(self) -> None:
        """Zero all gradient buffers (and ``param.grad``) before a new iteration."""
        for p in self.parameters_with_grad():
            p.grad = None
        for buf in self.buffers:
            buf.zero()
        self._next_to_launch = 0

    def release_grad_buffers(self) -> None:
        """ZeRO-2: free every bucket's full gradient storage (re-allocated on the next backward)."""
        if self.zero_stage == 2:
            for b in self.buckets:
                release_bucket(b)

    def local_shard(self, bucket: Bucket) -> tuple[int, int]:
        """``[lo, hi)`` within ``bucket`` that this rank's optimizer updates (whole bucket
        without the distributed optimizer)."""
        if not self.use_distributed_optimizer:
            return 0, bucket.numel
        comm = self._comm_of[id(bucket)]
        n = bucket.numel // comm.size
        return comm.rank * n, (comm.rank + 1) * n


class _Comm:
    """The group a buffer's buckets are reduced (and, with the distributed optimizer, sharded) over.

    ``divisor`` is what the gradients are divided by before the sum: the data-parallel size (dp x cp) for
    every buffer. An expert's gradient already sums the tokens of its ep group's ranks, so summing it over
    the expert-data-parallel group (dp x cp / ep ranks) and dividing by dp x cp is the same mean over every
    data-parallel rank's micro-batch as a dense weight gets.
    """

    def __init__(self, group: dist.ProcessGroup | None, divisor: int) -> None:
        self.group, self.divisor = group, divisor
        self.size, self.rank = group_size(group), group_rank(group)
