"""Parameter tags read through mg_parallel.tags: each accessor's value for an untagged parameter, and the global
block of a parameter against shards cut from a full tensor here."""

from itertools import product
from types import SimpleNamespace

import pytest
import torch

from mg_parallel.moe import GroupedExperts, expert_shard_info
from mg_parallel.params import grad_of
from mg_parallel.tags import (
    expert_layout,
    global_block,
    is_expert_parallel,
    is_fsdp,
    is_pipeline_replicated,
    is_sequence_parallel,
    is_shared_embedding,
    is_tensor_parallel,
    main_grad,
    param_replicas,
    partition_dim,
    set_expert_parallel,
    set_tensor_parallel,
)
from mg_parallel.tensor_parallel import shard_info


def _param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(shape))


def test_untagged_parameter():
    p = _param(4, 6)
    assert not any(f(p) for f in (is_sequence_parallel, is_expert_parallel, is_shared_embedding,
                                  is_pipeline_replicated, is_fsdp))
    assert main_grad(p) is None
    with pytest.raises(ValueError, match="'w' has no tensor_parallel tag"):
        is_tensor_parallel(p, "w")
    with pytest.raises(ValueError, match="no tensor_parallel tag"):
        partition_dim(p)
    with pytest.raises(ValueError, match="not an expert parameter"):
        expert_layout(p)
    assert global_block(p) == ((4, 6), (0, 0))  # at tp = 1 no tag is read
    with pytest.raises(ValueError, match="'w' has no tensor_parallel tag"):
        global_block(p, 2, 1, name="w")


def test_tagged_parameter():
    p = set_tensor_parallel(_param(4, 6), 1)
    p.sequence_parallel = p.shared_embedding = p.pipeline_replicated = True
    p.main_grad = torch.ones(4, 6)
    assert is_tensor_parallel(p) and partition_dim(p) == 1
    assert is_sequence_parallel(p) and is_shared_embedding(p) and is_pipeline_replicated(p)
    assert main_grad(p) is p.main_grad and grad_of(p) is p.main_grad
    replicated = set_tensor_parallel(_param(3), None)
    assert not is_tensor_parallel(replicated)
    with pytest.raises(ValueError, match="not a tensor-parallel shard"):
        partition_dim(replicated)
    assert expert_layout(set_expert_parallel(_param(2, 3), 8, 3)) == (8, 3)


def _check_blocks(full: torch.Tensor, shards: dict[tuple[int, int], torch.Tensor], tp: int) -> None:
    """Every shard's global block is the full tensor's shape, and its offset is where the shard was cut."""
    for (ep_rank, tp_rank), shard in shards.items():
        shape, offset = global_block(shard, tp, tp_rank)
        assert shape == tuple(full.shape), (ep_rank, tp_rank)
        block = full[tuple(slice(o, o + n) for o, n in zip(offset, shard.shape))]
        assert torch.equal(block, shard.detach()), (ep_rank, tp_rank, offset)


@pytest.mark.parametrize("dim", [0, 1])
def test_global_block_of_tensor_parallel_shards(dim):
    full, tp = torch.randn(8, 12), 4
    shards = {(0, r): set_tensor_parallel(torch.nn.Parameter(s.clone()), dim)
              for r, s in enumerate(full.chunk(tp, dim))}
    _check_blocks(full, shards, tp)
    for r, shard in shards.items():  # the tensor-parallel-only mapping agrees where there are no experts
        assert shard_info(shard, SimpleNamespace(tp_size=tp, tp_rank=r[1])) == global_block(shard, tp, r[1])
    replicated = set_tensor_parallel(torch.nn.Parameter(full.clone()), None)
    assert global_block(replicated, tp, 3) == ((8, 12), (0, 0))


def test_global_block_of_experts_split_over_ep_and_tp():
    """Experts ``[N, h, f]`` over ep = 4 (dim 0) and expert tensor parallelism 2 (the ``f`` dimension)."""
    full, ep, tp = torch.randn(8, 3, 6), 4, 2
    shards = {}
    for ep_rank, tp_rank in product(range(ep), range(tp)):
        block = full.chunk(ep, 0)[ep_rank].chunk(tp, 2)[tp_rank]
        p = set_expert_parallel(set_tensor_parallel(torch.nn.Parameter(block.clone()), 2), 8, ep_rank)
        shards[(ep_rank, tp_rank)] = p
        assert expert_shard_info(p, tp_size=tp, tp_rank=tp_rank) == global_block(p, tp, tp_rank)
    _check_blocks(full, shards, tp)


def test_global_block_of_grouped_experts_weights():
    """GroupedExperts keeps its slice of each full weight: global_block says which."""
    n, h, f, ep = 6, 4, 5, 3
    fulls = {"w1": torch.randn(n, h, 2, f), "w2": torch.randn(n, f, h)}
    by_shape = {tuple(full.shape): full for full in fulls.values()}
    for ep_rank in range(ep):
        experts = GroupedExperts(n, h, f, ep_size=ep, ep_rank=ep_rank,
                                 init_method=lambda w: w.copy_(by_shape[tuple(w.shape)]))
        for name, p in experts.named_parameters():
            _check_blocks(fulls[name], {(ep_rank, 0): p}, 1)


def test_param_replicas_number_the_holders_of_each_piece():
    """Over every rank of a tp2 x cp2 x dp2 layout, the ranks holding the same piece of a parameter get the indices
    0 .. count-1 once each."""
    tp, cp, dp = 2, 2, 2
    shard = set_tensor_parallel(_param(4), 0)
    replicated = set_tensor_parallel(_param(4), None)
    for param, dp_sharded, holders in [(replicated, False, tp * cp * dp), (shard, False, cp * dp),
                                       (replicated, True, tp), (shard, True, 1)]:
        seen: dict[tuple, list[int]] = {}
        for t, c, d in product(range(tp), range(cp), range(dp)):
            grid = SimpleNamespace(tp_size=tp, tp_rank=t, cp_size=cp, cp_rank=c, dp_size=dp, dp_rank=d, ep_size=1)
            index, count = param_replicas(param, grid, dp_sharded=dp_sharded)
            assert count == holders
            # the piece a rank holds: its tp shard (if tp-split), its dp x cp flat range (if dp-sharded)
            piece = ((t,) if is_tensor_parallel(param) else ()) + ((c, d) if dp_sharded else ())
            seen.setdefault(piece, []).append(index)
        assert all(sorted(v) == list(range(holders)) for v in seen.values()), (holders, seen)
