"""Context parallelism: attention over a sequence split across ranks.

The sequence is cut into ``2 * cp`` chunks and rank ``r`` holds chunks ``r`` and ``2cp-1-r``
(:mod:`.chunking`), which balances causal work. :func:`context_parallel_attention` computes
attention over the whole sequence with one of three communication schemes (``parallel.cp_comm``):

* ``"p2p"``: ring attention, K/V blocks passed around the ring overlapped with compute (:mod:`.ring`);
* ``"allgather"``: K/V all-gathered once, then the ring's blocks and masks (:mod:`.allgather`);
* ``"a2a"``: Ulysses all-to-all, sequence split traded for a head split around attention.

See ``packages/mg-parallel/README.md`` ("Context parallelism").
"""

from mg_parallel.context_parallel.attention import (
    CP_COMM_KINDS,
    ContextParallelConfig,
    check_cp_comm,
    context_parallel_attention,
)
from mg_parallel.context_parallel.blocks import block_attention_impl
from mg_parallel.context_parallel.chunking import (
    cp_position_ids,
    gather_from_cp,
    split_for_cp,
    unsplit_from_cp,
)
from mg_parallel.context_parallel.masks import attention_mask, document_ids_from_cu_seqlens

__all__ = [
    "CP_COMM_KINDS",
    "ContextParallelConfig",
    "attention_mask",
    "block_attention_impl",
    "check_cp_comm",
    "context_parallel_attention",
    "cp_position_ids",
    "document_ids_from_cu_seqlens",
    "gather_from_cp",
    "split_for_cp",
    "unsplit_from_cp",
]
