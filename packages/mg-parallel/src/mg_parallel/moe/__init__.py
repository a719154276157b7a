"""Mixture of experts with expert parallelism: router, token dispatchers, grouped experts, the MoE layer.

See ``packages/mg-parallel/README.md`` ("Mixture of experts") for turning your own MLP into an
expert layer.
"""

from mg_parallel.moe.config import MoEConfig
from mg_parallel.moe.dispatcher import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    build_dispatcher,
    expert_capacity,
    keep_within_capacity,
)
from mg_parallel.moe.experts import (
    GroupedExperts,
    allreduce_expert_grads,
    expert_shard_info,
    grouped_mm_supported,
    is_expert_param,
)
from mg_parallel.moe.layer import MoEGroups, MoELayer, moe_losses
from mg_parallel.moe.router import TopKRouter, update_expert_biases

__all__ = [
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "GroupedExperts",
    "MoEConfig",
    "MoEGroups",
    "MoELayer",
    "TopKRouter",
    "allreduce_expert_grads",
    "build_dispatcher",
    "expert_capacity",
    "expert_shard_info",
    "grouped_mm_supported",
    "is_expert_param",
    "keep_within_capacity",
    "moe_losses",
    "update_expert_biases",
]
