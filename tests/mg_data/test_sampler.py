"""The sampler: global batches independent of dp size, resumable across layout changes."""

from __future__ import annotations

import numpy as np
import pytest

from mg_data.sampler import GlobalBatchSampler


def global_batches(dp_size, consumed=0, split="contiguous", shuffle=False, total=1000, gbs=16, mbs=2):
    """Reassemble the global batches from every rank's micro-batches, as a training step sees them."""
    ranks = [iter(GlobalBatchSampler(total_samples=total, global_batch_size=gbs, micro_batch_size=mbs,
                                     dp_rank=r, dp_size=dp_size, consumed_samples=consumed, split=split,
                                     shuffle=shuffle, seed=5)) for r in range(dp_size)]
    num_micro = gbs // (mbs * dp_size)
    out = []
    while True:
        try:
            step = [[next(it) for _ in range(num_micro)] for it in ranks]
        except StopIteration:
            return out
        out.append(sorted(i for rank in step for mb in rank for i in mb))


@pytest.mark.parametrize("split", ["contiguous", "strided"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_same_global_batches_for_dp_1_2_4(split, shuffle):
    ref = global_batches(1, split=split, shuffle=shuffle)
    assert len(ref) == 1000 // 16
    assert sorted(i for b in ref for i in b) == list(range(62 * 16)) or shuffle
    for dp in (2, 4):
        assert global_batches(dp, split=split, shuffle=shuffle) == ref
    if not shuffle:
        assert ref[3] == list(range(48, 64))
    else:
        flat = [i for b in ref for i in b]
        assert len(set(flat)) == len(flat) and flat != sorted(flat)


def test_resume_with_a_different_dp_size_continues_the_stream():
    ref = global_batches(1, shuffle=True)
    for dp in (1, 2, 4):
        assert global_batches(dp, consumed=10 * 16, shuffle=True) == ref[10:]
    s = GlobalBatchSampler(total_samples=1000, global_batch_size=16, micro_batch_size=2, dp_rank=1, dp_size=2)
    it = iter(s)
    for _ in range(4 * 3):
        next(it)
    assert s.consumed_samples == 48  # three whole global batches handed out
    state = s.state_dict()
    t = GlobalBatchSampler(total_samples=1000, global_batch_size=16, micro_batch_size=4, dp_rank=0, dp_size=4)
    t.load_state_dict(state)
    assert len(t) == 62 - 3 and next(iter(t)) == [48, 49, 50, 51] and len(t) == 62 - 4


def test_micro_batch_layout():
    s = GlobalBatchSampler(total_samples=64, global_batch_size=8, micro_batch_size=2, dp_rank=1, dp_size=2)
    assert s.micro_batches(0) == [[4, 5], [6, 7]] and s.num_micro_batches == 2 and len(s) == 16
    s = GlobalBatchSampler(total_samples=64, global_batch_size=8, micro_batch_size=2, dp_rank=1, dp_size=2,
                           split="strided")
    assert s.micro_batches(0) == [[1, 3], [5, 7]]
    np.testing.assert_array_equal(s.global_batch(1), np.arange(8, 16))


def test_validation_messages():
    kw = dict(total_samples=100, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=2)
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        GlobalBatchSampler(**{**kw, "dp_size": 3})
    with pytest.raises(ValueError, match="dp_rank 2 outside"):
        GlobalBatchSampler(**{**kw, "dp_rank": 2})
    with pytest.raises(ValueError, match="consumed_samples 4"):
        GlobalBatchSampler(**kw, consumed_samples=4)
    s = GlobalBatchSampler(**kw)
    with pytest.raises(ValueError, match="global_batch_size=16"):
        s.load_state_dict({**s.state_dict(), "global_batch_size": 16})
