"""Tensor and sequence parallelism: parallel layers, their communication, loss, RNG streams.

See ``packages/mg-parallel/README.md`` ("Tensor and sequence parallelism") for an example of
parallelising your own model with these layers.
"""

from mg_parallel.tensor_parallel.cross_entropy import (
    chunked_vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy,
)
from mg_parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    InitMethod,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    mark_sequence_parallel,
    normal_init_method,
)
from mg_parallel.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from mg_parallel.tensor_parallel.random import TENSOR_PARALLEL_STREAM, RNGTracker
from mg_parallel.tensor_parallel.utils import (
    divide,
    group_rank,
    group_size,
    is_tensor_parallel,
    mark_replicated,
    pad_vocab_size,
    set_tensor_parallel,
    shard_info,
    vocab_range,
)

__all__ = [
    "TENSOR_PARALLEL_STREAM",
    "ColumnParallelLinear",
    "InitMethod",
    "RNGTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "chunked_vocab_parallel_cross_entropy",
    "copy_to_tp_region",
    "divide",
    "gather_from_sequence_parallel_region",
    "gather_from_tp_region",
    "group_rank",
    "group_size",
    "is_tensor_parallel",
    "mark_replicated",
    "mark_sequence_parallel",
    "normal_init_method",
    "pad_vocab_size",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region",
    "set_tensor_parallel",
    "shard_info",
    "vocab_parallel_cross_entropy",
    "vocab_range",
]
