"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Megatron's MLP is ``RowParallel(act(ColumnParallel(x)))``: the column-parallel layer splits the
output features (each rank holds ``[out/tp, in]``), the row-parallel layer splits the input
features (``[out, in/tp]``) and sums the ranks' partial outputs, so one all-reduce per block
suffices forward and one backward. Attention splits heads the same way.

With ``sequence_parallel=True`` the activations between tensor-parallel regions are split
along the sequence (dim 0 of ``[s, b, h]``): the column-parallel layer all-gathers its input
and the row-parallel layer reduce-scatters its output, which moves the same bytes as the
all-reduce but keeps norms, dropout and residuals on ``s/tp`` tokens per rank.

With a tensor-parallel group of None or of one rank every layer is exactly its recipe's ``linear``
(``F.linear`` for the plain recipe) / ``F.embedding`` on the full weight: no autograd wrapper, no copy.

Every matmul of the linear layers, forward and backward, goes through the layer's GEMM recipe
(``layer.gemm``, a :class:`~mg_parallel.gemm.Gemm`; see :mod:`mg_parallel.gemm`).

Initialisation: a layer builds the FULL weight in fp32 on its device, calls
``init_method(full)`` and keeps its shard, so a tp=k model equals the tp=1 model for the same
``init_method`` and random state. Biases start at zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mg_parallel.collectives import all_reduce_coalesced
from mg_parallel.gemm import PLAIN_GEMM, Gemm
from mg_parallel.params import grad_of, unique_params
from mg_parallel.tags import is_sequence_parallel
from mg_parallel.tensor_parallel.mappings import (
    all_gather_dim0,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_dim0,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from mg_parallel.tensor_parallel.utils import (
    divide,
    group_rank,
    group_size,
    mark_replicated,
    set_tensor_parallel,
    vocab_range,
)

__all__ = [
    "ColumnParallelLinear",
    "InitMethod",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "mark_sequence_parallel",
    "normal_init_method",
]

InitMethod = Callable[[torch.Tensor], None]
"""Fills a full (unsharded) fp32 weight in place."""


def normal_init_method(std: float = 0.02) -> InitMethod:
    """An ``init_method`` drawing from ``N(0, std^2)`` with the default generator (Megatron's default).

    Raises:
        ValueError: ``std`` is negative.
    """
    if std < 0:
        raise ValueError(f"init std must be >= 0, got {std}")

    def init(weight: torch.Tensor) -> None:
        nn.init.normal_(weight, mean=0.0, std=std)

    return init


def _sharded_weight(
    full_shape: tuple[int, int],
    partition_dim: int,
    group: dist.ProcessGroup | None,
    init_method: InitMethod | None,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> nn.Parameter:
    """Initialise the full weight in fp32 and return this rank's shard as a parameter."""
    dtype = dtype or torch.get_default_dtype()
    device = torch.device(device) if device is not None else None
    world, rank = group_size(group), group_rank(group)
    if device is not None and device.type == "meta":
        shape = list(full_shape)
        shape[partition_dim] //= world
        return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    master = torch.empty(full_shape, dtype=torch.float32, device=device)
    (init_method or normal_init_method())(master)
    if world > 1:
        part = full_shape[partition_dim] // world
        master = master.narrow(partition_dim, rank * part, part)
    return nn.Parameter(master.to(dtype=dtype, memory_format=torch.contiguous_format, copy=world > 1))


class _ColumnLinearFn(torch.autograd.Function):
    """Column-parallel matmul with its input communication fused into one autograd node.

    Forward: (all-gather the sequence dim when sequence parallel) then ``x @ W^T + b`` (the recipe's
    ``linear``); backward: the input and weight gradients with the recipe's ``mm``.
    Backward: the input-gradient collective (all-reduce, or reduce-scatter under sequence
    parallelism) is launched asynchronously and overlapped with the weight-gradient matmul.
    Under sequence parallelism only the local input shard is saved; the full input is
    all-gathered again in backward, overlapped with the input-gradient matmul.
    """

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
        sequence_parallel: bool,
        gemm: Gemm,
    ) -> torch.Tensor:
        ctx.group = group
        ctx.sequence_parallel = sequence_parallel
        ctx.gemm = gemm
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x, weight)
        total = all_gather_dim0(x, group) if sequence_parallel else x
        return gemm.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        group, sp, gemm = ctx.group, ctx.sequence_parallel, ctx.gemm
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # Under autocast the forward matmul ran in a lower precision than the saved tensors:
        # do the backward matmuls in the gradient's dtype and return grads in the inputs' dtypes.
        compute = grad_out.dtype
        if sp and need_w:
            total, gather_work = all_gather_dim0(x, group, async_op=True)
        else:
            total, gather_work = x, None

        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])  # [s*b, out/tp]
        grad_input, work = None, None
        if need_x:
            # [s*b, out/tp] @ [out/tp, in] -> [s, b, in] (the fold torch.matmul makes of [s, b, out/tp] @ [out/tp, in])
            grad_input = gemm.mm(grad_2d, weight.to(compute)).view(*grad_out.shape[:-1], weight.shape[-1])
            if grad_input.dtype != x.dtype:
                grad_input = grad_input.to(x.dtype)
            if sp:
                if gather_work is not None:
                    # A second collective may not start before the first completes on some
                    # backends' single communication stream; keep the order explicit.
                    gather_work.wait()
                    gather_work = None
                grad_input, work = reduce_scatter_dim0(grad_input, group, async_op=True)
            else:
                work = dist.all_reduce(grad_input, group=group, async_op=True)

        grad_weight = grad_bias = None
        if need_w or need_b:
            if need_w:
                if gather_work is not None:
                    gather_work.wait()
                grad_weight = gemm.mm(grad_2d.t(), total.reshape(-1, total.shape[-1]).to(compute)).to(weight.dtype)
            if need_b and ctx.bias_dtype is not None:
                grad_bias = grad_2d.sum(0).to(ctx.bias_dtype)
        if work is not None:
            work.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split along its output features over the tensor-parallel group.

    Args:
        in_features: input features (full).
        out_features: output features (full); must be divisible by the tp size.
        tp_group: tensor-parallel process group; None means one rank (plain ``nn.Linear``).
        bias: add a bias (split like the output features; zero-initialised).
        gather_output: all-gather the output so every rank holds ``[..., out]``; otherwise
            each rank returns its ``[..., out/tp]`` shard.
        sequence_parallel: the input is this rank's ``[s/tp, b, in]`` sequence shard and is
            all-gathered to ``[s, b, in]`` before the matmul.
        init_method: fills the full fp32 weight ``[out, in]`` in place (default ``N(0, 0.02^2)``).
        dtype, device: of the parameters.
        async_grad_allreduce: overlap the input-gradient all-reduce (or reduce-scatter) with
            the weight-gradient matmul in backward.
        gemm: the GEMM recipe of every matmul here, forward and backward (``self.gemm``; default the
            plain ``F.linear``/``torch.mm``; :func:`~mg_parallel.gemm.use_gemm` changes it later).

    Shapes: input ``[*, in]`` (``[s/tp, b, in]`` with sequence parallelism), output
    ``[*, out/tp]`` or ``[*, out]`` with ``gather_output`` (leading dims ``[s, b]`` under
    sequence parallelism). Local weight ``[out/tp, in]``, marked ``tensor_parallel=True``,
    ``partition_dim=0``.

    Raises:
        ValueError: ``out_features`` is not divisible by the tensor-parallel size.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: dist.ProcessGroup | None = None,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        async_grad_allreduce: bool = True,
        gemm: Gemm = PLAIN_GEMM,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.async_grad_allreduce = async_grad_allreduce
        self.gemm = gemm
        self.out_features_per_rank = divide(out_features, self.tp_size, "ColumnParallelLinear out_features")
        self.weight = _sharded_weight((out_features, in_features), 0, tp_group, init_method, dtype, device)
        set_tensor_parallel(self.weight, 0)
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(self.out_features_per_rank, dtype=self.weight.dtype, device=self.weight.device)
            )
            set_tensor_parallel(self.bias, 0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer; see the class docstring for shapes."""
        if self.tp_size == 1:
            return self.gemm.linear(x, self.weight, self.bias)
        if self.sequence_parallel or self.async_grad_allreduce:
            y = _ColumnLinearFn.apply(x, self.weight, self.bias, self.tp_group, self.sequence_parallel, self.gemm)
        else:
            y = self.gemm.linear(copy_to_tp_region(x, self.tp_group), self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tp_region(y, self.tp_group)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp_size}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split along its input features over the tensor-parallel group.

    Each rank multiplies its ``[*, in/tp]`` input slice by its ``[out, in/tp]`` weight slice;
    the partial outputs are summed over the group (all-reduce, or reduce-scatter along the
    sequence with ``sequence_parallel``); then the replicated bias is added.

    Args:
        in_features: input features (full); must be divisible by the tp size.
        out_features: output features.
        tp_group: tensor-parallel process group; None means one rank (plain ``nn.Linear``).
        bias: add a bias (replicated, zero-initialised; marked ``sequence_parallel=True``
            under sequence parallelism since each rank then sees only its tokens' gradient).
        input_is_parallel: the input is already this rank's ``[*, in/tp]`` slice (the output
            of a column-parallel layer); otherwise the full ``[*, in]`` input is split here.
        sequence_parallel: reduce-scatter the output to ``[s/tp, b, out]``.
        init_method: fills the full fp32 weight ``[out, in]`` in place (default ``N(0, 0.02^2)``).
        dtype, device: of the parameters.
        gemm: the GEMM recipe of the matmul (``self.gemm``; default the plain ``F.linear``).

    Local weight ``[out, in/tp]``, marked ``tensor_parallel=True``, ``partition_dim=1``; the bias
    ``tensor_parallel=False``.

    Raises:
        ValueError: ``in_features`` is not divisible by the tp size, or ``sequence_parallel``
            without ``input_is_parallel``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: dist.ProcessGroup | None = None,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        gemm: Gemm = PLAIN_GEMM,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel=True requires input_is_parallel=True "
                "(feed it the output of a ColumnParallelLinear)"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.gemm = gemm
        self.in_features_per_rank = divide(in_features, self.tp_size, "RowParallelLinear in_features")
        self.weight = _sharded_weight((out_features, in_features), 1, tp_group, init_method, dtype, device)
        set_tensor_parallel(self.weight, 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=self.weight.dtype, device=self.weight.device))
            set_tensor_parallel(self.bias, None)  # replicated: added after the sum over ranks
            if sequence_parallel:
                self.bias.sequence_parallel = True
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer: ``[*, in/tp]`` (or ``[*, in]``) -> ``[*, out]`` (``[s/tp, b, out]`` with SP)."""
        if self.tp_size == 1:
            return self.gemm.linear(x, self.weight, self.bias)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group)
        partial = self.gemm.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            # A linear's backward reads its inputs, not its output: reduce the output in place.
            y = reduce_from_tp_region(partial, self.tp_group, inplace=True)
        # (cast: under autocast y is in the autocast dtype, as nn.Linear's output would be)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp_size}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding table split along the vocabulary over the tensor-parallel group.

    Rank ``r`` holds rows ``[r*V/tp, (r+1)*V/tp)``. Each rank looks up the ids it owns, writes
    zeros for the others, and the ranks' outputs are summed (all-reduce, or reduce-scatter
    along the sequence with ``sequence_parallel``).

    Args:
        num_embeddings: vocabulary size, already padded to a multiple of the tp size (see
            :func:`~mg_parallel.tensor_parallel.pad_vocab_size`).
        embedding_dim: hidden size.
        tp_group: tensor-parallel process group; None means one rank (plain ``nn.Embedding``).
        sequence_parallel: reduce-scatter the output along dim 0 (ids must be ``[s, b]``).
        init_method: fills the full fp32 table ``[V, h]`` in place (default ``N(0, 0.02^2)``).
        dtype, device: of the table.

    Shapes: ids ``[s, b]`` (any shape without sequence parallelism) -> ``[s, b, h]``, or
    ``[s/tp, b, h]`` with sequence parallelism. Local table ``[V/tp, h]``, marked
    ``tensor_parallel=True``, ``partition_dim=0``.

    Raises:
        ValueError: ``num_embeddings`` is not divisible by the tp size.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.sequence_parallel = sequence_parallel
        divide(num_embeddings, self.tp_size, "VocabParallelEmbedding num_embeddings (pad it with pad_vocab_size)")
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, group_rank(tp_group), self.tp_size)
        self.weight = _sharded_weight((num_embeddings, embedding_dim), 0, tp_group, init_method, dtype, device)
        set_tensor_parallel(self.weight, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Look up ``ids`` (int64, any shape; ``[s, b]`` with sequence parallelism) -> ``[*ids.shape, h]``."""
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local_ids, self.weight)
        # Embedding's backward does not read its output, so zeroing it in place is safe.
        out = out.masked_fill_(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tp_region(out, self.tp_group, inplace=True)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, "
            f"rows=[{self.vocab_start}, {self.vocab_end}), sequence_parallel={self.sequence_parallel}"
        )


def mark_sequence_parallel(module: nn.Module) -> nn.Module:
    """Mark every parameter of ``module`` (e.g. a LayerNorm) ``sequence_parallel=True``; returns it.

    Use it on replicated modules that run on sequence-parallel activations: their gradients
    are partial per rank and must be summed over the tensor-parallel group before the step
    (:func:`allreduce_sequence_parallel_grads`, or the DDP wrapper's ``finalize_model_grads``).
    Being replicated, parameters without a tensor-parallel tag are also tagged so
    (:func:`~mg_parallel.tensor_parallel.mark_replicated`).
    """
    mark_replicated(module)
    for p in module.parameters():
        p.sequence_parallel = True
    return module


def allreduce_sequence_parallel_grads(
    module: nn.Module | Iterable[nn.Module], tp_group: dist.ProcessGroup | None
) -> None:
    """Sum the gradients of parameters marked ``sequence_parallel=True`` over ``tp_group``.

    Under sequence parallelism each rank back-propagates through its own tokens only, so the
    gradients of replicated parameters applied to sequence shards (norm weights, the
    row-parallel bias) are partial; this makes them the full gradient on every rank. Reads
    ``param.main_grad`` when present (the DDP grad buffer), else ``param.grad``; a parameter
    shared by several modules is reduced once. One all-reduce per dtype. Call it after backward, before the optimizer step, on every tp rank
    with the same module structure. No-op for a group of None or one rank.
    """
    if group_size(tp_group) == 1:
        return
    modules = [module] if isinstance(module, nn.Module) else list(module)
    sp = [g for p in unique_params(modules) if is_sequence_parallel(p) and (g := grad_of(p)) is not None]
    all_reduce_coalesced(sp, tp_group)
