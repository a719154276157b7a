"""Context-parallel attention against attention on the whole sequence in one process.

Each rank holds its load-balanced part of q, k, v (chunks r and 2cp-1-r); its output and its
part of dQ/dK/dV must equal the matching slices of an explicit masked softmax computed on the
full sequence. One ``run_distributed`` call per world size loops over every communication kind
and mask, so the workers start once.
"""

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from mg_parallel.context_parallel import (
    ContextParallelConfig,
    attention_mask,
    block_attention_impl,
    check_cp_comm,
    context_parallel_attention,
    cp_position_ids,
    document_ids_from_cu_seqlens,
    gather_from_cp,
    split_for_cp,
    unsplit_from_cp,
)
from mg_parallel.context_parallel.dropout import dropout_keep_mask
from mg_parallel.grid import ParallelDims, build_grid

TOL = {"rtol": 1e-5, "atol": 1e-5}
B, D = 2, 8
WORLD = 4


def _reference(q, k, v, causal, window, docs, scale, dropout=None):
    """Masked softmax written out on the full sequence: [b, hq, s, d]; ``dropout=(p, seed)`` drops the
    probabilities that ``dropout_keep_mask`` (the definition of the masks) drops at global positions and scales
    the rest by 1/(1-p)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q.shape[2]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    keep = torch.ones(B, s, s, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= ((i - j) < window) if causal else ((i - j).abs() < window)
    if docs is not None:
        keep &= docs[:, :, None] == docs[:, None, :]
    scores = (q @ k.transpose(-1, -2)) * scale
    probs = scores.masked_fill(~keep[:, None], float("-inf")).softmax(-1)
    if dropout is not None:
        p, seed = dropout
        kept = dropout_keep_mask(seed, p, B, torch.arange(q.shape[1]), torch.arange(s), torch.arange(s))
        probs = probs * kept / (1 - p)
    return probs @ v


def _documents(s: int, gen: torch.Generator) -> torch.Tensor:
    # Random boundaries per batch row (a document may be a single token).
    starts = torch.rand(B, s, generator=gen) < 0.15
    starts[:, 0] = True
    return starts.long().cumsum(1)


def _cases():
    for causal in (True, False):
        for hq, hkv in ((4, 4), (8, 2)):
            # GQA inputs arrive as [b, s, h, d] transposed: strided, as a fused qkv projection gives them.
            yield dict(causal=causal, hq=hq, hkv=hkv, window=None, docs=False, strided=hkv < hq)
        yield dict(causal=causal, hq=4, hkv=2, window=5, docs=False)
        yield dict(causal=causal, hq=4, hkv=4, window=None, docs=True)
    yield dict(causal=True, hq=4, hkv=2, window=1, docs=False)
    yield dict(causal=True, hq=4, hkv=4, window=3, docs=True)


def _check_case(group, cp, rank, comm, case, gen, impl=None, dtype=torch.float32, device="cpu", s=None,
                dropout=None):
    """Reference on the CPU; the ranks compute on ``device`` (the grid's: CUDA under NCCL)."""
    s = s or 8 * cp
    hq, hkv, causal, window = case["hq"], case["hkv"], case["causal"], case["window"]
    if comm == "a2a" and (hq % cp or hkv % cp):
        with pytest.raises(ValueError, match=rf"parallel.cp={cp}.*{hq} heads and {hkv} kv heads"):
            context_parallel_attention(torch.zeros(B, hq, s // cp, D, device=device),
                                       *[torch.zeros(B, hkv, s // cp, D, device=device)] * 2,
                                       group=group, comm=comm)
        return 0
    q, k, v = torch.randn(B, hq, s, D, generator=gen), *torch.randn(2, B, hkv, s, D, generator=gen)
    dout = torch.randn(B, hq, s, D, generator=gen)
    docs = _documents(s, gen) if case["docs"] else None
    scale = 0.3
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = _reference(*full, causal, window, docs, scale, dropout)
    ref.backward(dout)
    drop = {} if dropout is None else {"dropout_p": dropout[0], "dropout_seed": dropout[1].to(device)}

    local = [split_for_cp(t, rank, cp, seq_dim=2).to(device, dtype).requires_grad_(True) for t in (q, k, v)]
    if case.get("strided"):
        local = [t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True) for t in local]
        assert not local[0].is_contiguous()
    local_docs = None if docs is None else split_for_cp(docs, rank, cp, seq_dim=1).to(device)
    out = context_parallel_attention(*local, group=group, comm=comm, causal=causal, window=window,
                                     document_ids=local_docs, scale=scale, impl=impl, **drop)
    out.backward(split_for_cp(dout, rank, cp, seq_dim=2).to(device, dtype))
    what = f"cp={cp} rank={rank} comm={comm} impl={impl} {dtype} {case} dropout={dropout}"
    tol = TOL if dtype == torch.float32 else {"rtol": 0.05, "atol": 0.05}
    assert out.dtype == dtype and all(t.grad.dtype == dtype for t in local)
    assert_close(out.float().cpu(), split_for_cp(ref.detach(), rank, cp, 2), **tol, msg=lambda m: f"{what} out: {m}")
    for name, mine, whole in zip("qkv", local, full):
        assert_close(mine.grad.float().cpu(), split_for_cp(whole.grad, rank, cp, 2), **tol,
                     msg=lambda m, n=name: f"{what} d{n}: {m}")
    assert_close(gather_from_cp(out.detach().float(), group, seq_dim=2).cpu(), ref.detach(), **tol)
    return 1


def _check_all(cp: int) -> int:
    grid = build_grid(ParallelDims(cp=cp))
    group, rank = grid.cp_group, grid.cp_rank
    gen = torch.Generator().manual_seed(3)  # same inputs on every rank
    checked = 0
    for comm in ("p2p", "allgather", "a2a"):
        for case in _cases():
            checked += _check_case(group, cp, rank, comm, case, gen, device=grid.device)
    for case in list(_cases())[1:4]:  # the plain-torch kernel (CUDA's today): GQA, window, documents
        checked += _check_case(group, cp, rank, "p2p", case, gen, impl="reference", device=grid.device)
    from mg_parallel.context_parallel import plan

    default_tile, plan.MIN_TILE = plan.MIN_TILE, 2  # windows cut 16-token chunk pairs into tiles along their band
    try:
        assert len(plan.step_blocks(rank, rank, cp, 32, True, 1)) > 2, "the chunks must be cut into tiles"
        for comm in ("p2p", "allgather"):
            for case in _cases():
                if case["window"] is not None:
                    checked += _check_case(group, cp, rank, comm, case, gen, device=grid.device, s=32 * cp)
    finally:
        plan.MIN_TILE = default_tile
    dropout = (0.3, torch.tensor(20261202))
    for comm in ("p2p", "allgather"):  # attention dropout: GQA, a window, documents (bidirectional too)
        for case in [c for c in _cases() if c["hq"] > c["hkv"] or c["docs"]][:4]:
            checked += _check_case(group, cp, rank, comm, case, gen, device=grid.device, dropout=dropout)
    for comm in ("p2p", "allgather", "a2a"):  # bf16 inputs: fp32 statistics, bf16 results
        checked += _check_case(group, cp, rank, comm, dict(causal=True, hq=4, hkv=4, window=None, docs=True), gen,
                               dtype=torch.bfloat16, device=grid.device)
    return checked


@pytest.mark.parametrize("cp", [4, 2])
def test_context_parallel_attention_matches_full_sequence(cp):
    """Four ranks for both sizes (cp=2 as two cp groups side by side), so one pool serves the file."""
    from mg_parallel.testing import run_distributed

    counts = run_distributed(_check_all, WORLD, cp)
    a2a = sum(1 for c in _cases() if c["hq"] % cp == 0 and c["hkv"] % cp == 0)  # others check the error
    windows = sum(1 for c in _cases() if c["window"] is not None)
    expected = 2 * len(list(_cases())) + a2a + 3 + 2 * windows + 2 * 4 + 3
    assert counts == [expected] * WORLD


def test_single_process_is_plain_attention():
    gen = torch.Generator().manual_seed(0)
    for case in _cases():
        assert _check_case(None, 1, 0, "p2p", case, gen) == 1
        assert _check_case(None, 1, 0, "p2p", case, gen, dropout=(0.3, torch.tensor(7))) == 1


def test_dropout_masks_keep_1_minus_p_independently_of_the_layout():
    """The hashed masks keep 1 - p of the probabilities, independently per element and per seed, and a block's
    mask is the slice of the whole sequence's at its global positions (what makes every layout drop alike)."""
    seed, p = torch.tensor(123), 0.3
    whole = dropout_keep_mask(seed, p, 4, torch.arange(8), torch.arange(256), torch.arange(256))
    assert abs(whole.float().mean().item() - (1 - p)) < 0.003  # 2M draws: 4 standard deviations is 0.0013
    other = dropout_keep_mask(torch.tensor(124), p, 4, torch.arange(8), torch.arange(256), torch.arange(256))
    assert abs((whole == other).float().mean().item() - ((1 - p) ** 2 + p ** 2)) < 0.003  # independent seeds
    a, b = whole[..., :-1].float(), whole[..., 1:].float()
    assert abs(((a - a.mean()) * (b - b.mean())).mean().item()) / a.var().item() < 0.01  # neighbours uncorrelated
    block = dropout_keep_mask(seed, p, 4, torch.arange(2, 5), torch.arange(40, 60), torch.arange(7, 30))
    assert torch.equal(block, whole[:, 2:5, 40:60, 7:30])
    with pytest.raises(ValueError, match="cp_comm='a2a'"):
        context_parallel_attention(*torch.zeros(3, 1, 2, 4, 8), group=None, comm="a2a", dropout_p=0.1,
                                   dropout_seed=seed)
    with pytest.raises(ValueError, match="dropout_seed"):
        context_parallel_attention(*torch.zeros(3, 1, 2, 4, 8), group=None, dropout_p=0.1)


def test_chunking_round_trip_and_global_positions():
    s, cp = 24, 3
    x = torch.arange(2 * s).view(2, s)
    parts = [split_for_cp(x, r, cp, seq_dim=1) for r in range(cp)]
    assert parts[0][0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert parts[1][0].tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    assert torch.equal(unsplit_from_cp(parts, seq_dim=1), x)
    for r in range(cp):
        assert torch.equal(cp_position_ids(s // cp, r, cp), parts[r][0])
    h = torch.randn(2, 3, s, 4)
    assert torch.equal(unsplit_from_cp([split_for_cp(h, r, cp, 2) for r in range(cp)], seq_dim=2), h)
    with pytest.raises(ValueError, match="not divisible by 2 \\* parallel.cp = 6"):
        split_for_cp(torch.zeros(1, 10), 0, cp)


def test_masks_and_kernel_names():
    pos = torch.arange(6)
    m = attention_mask(pos, pos, causal=True, window=2)[0]
    assert m[3].tolist() == [False, False, True, True, False, False]
    assert attention_mask(pos, pos, causal=False, window=None) is None
    assert document_ids_from_cu_seqlens(torch.tensor([0, 3, 4, 7]), 9).tolist() == [0, 0, 0, 1, 2, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="cu_seqlens"):
        document_ids_from_cu_seqlens(torch.tensor([0, 5, 3]), 8)
    assert block_attention_impl("cpu", torch.float32, "causal") == "flash-cpu"
    assert block_attention_impl("cpu", torch.float32, "masked") == "flash-cpu"
    assert block_attention_impl("cpu", torch.float64, "causal") == "reference"
    # CUDA's flash kernel serves unmasked bf16 blocks once its probe against the reference passed on the device;
    # without a GPU (or if the probe fails) the reference does, and masked blocks always use it.
    assert block_attention_impl("cuda", torch.bfloat16, "causal") == ("flash-cuda" if torch.cuda.is_available()
                                                                      else "reference")
    assert block_attention_impl("cuda", torch.bfloat16, "masked") == "reference"


def test_ring_steps_are_balanced_and_windows_skip_blocks():
    """Causal ring: every step after the first costs every rank 2c^2 scores; a window drops pairs."""
    from mg_parallel.context_parallel.plan import step_blocks

    cp, c = 4, 4
    for rank in range(cp):
        for i in range(cp):
            blocks = step_blocks(rank, (rank - i) % cp, cp, 2 * c, causal=True, window=None)
            area = sum((qs.stop - qs.start) * (ks.stop - ks.start) for qs, ks, _ in blocks)
            assert area == (4 if i == 0 else 2) * c * c, (rank, i, blocks)
            assert [kind for _, _, kind in blocks] == ["causal" if i == 0 else "full"]
    # Window 2 on chunks of 4: each rank keeps its two diagonal pairs and the neighbouring chunk only.
    kept = [len(step_blocks(0, src, cp, 2 * c, causal=True, window=2)) for src in range(cp)]
    assert kept == [2, 1, 0, 0], kept  # rank 0 holds chunks 0 and 7; chunk 7 also sees chunk 6, on rank 1


def test_window_block_kinds_follow_the_positions():
    """The kinds step_blocks derives from chunk positions agree with the masks the positions give."""
    from mg_parallel.context_parallel.plan import step_blocks

    cp, c = 3, 4
    tril = torch.ones(c, c, dtype=torch.bool).tril()
    for causal in (True, False):
        for window in (1, 2, 3, 4, 5, 8, 9, 100):
            for rank in range(cp):
                for src in range(cp):
                    q_pos, k_pos = cp_position_ids(2 * c, rank, cp), cp_position_ids(2 * c, src, cp)
                    kinds = {(qs.start, ks.start): kind for qs, ks, kind in
                             step_blocks(rank, src, cp, 2 * c, causal=causal, window=window)}
                    for q0 in (0, c):
                        for k0 in (0, c):
                            m = attention_mask(q_pos[q0 : q0 + c], k_pos[k0 : k0 + c], causal=causal,
                                               window=window)[0]
                            kind, where = kinds.get((q0, k0)), (causal, window, rank, src, q0, k0)
                            assert (kind is None) == (not m.any()) and (kind == "full") == bool(m.all()), where
                            assert kind != "causal" or torch.equal(m, tril), where  # else "masked" is exact
                            assert kind != "masked" or (m.any() and not m.all()), where


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="parallel.cp_comm='ring'.*p2p, allgather, a2a"):
        check_cp_comm("ring")
    with pytest.raises(ValueError, match="parallel.cp_comm"):
        ContextParallelConfig(comm="nccl")
    q = torch.zeros(1, 2, 4, D)
    with pytest.raises(ValueError, match="parallel.cp_comm"):
        context_parallel_attention(q, q, q, group=None, comm="x")
    with pytest.raises(ValueError, match="window must be >= 1"):
        context_parallel_attention(q, q, q, group=None, window=0)
    with pytest.raises(ValueError, match="impl='cuda' is not a block kernel"):
        context_parallel_attention(q, q, q, group=None, impl="cuda")
    with pytest.raises(ValueError, match="document_ids must be"):
        context_parallel_attention(q, q, q, group=None, document_ids=torch.zeros(1, 3, dtype=torch.long))


def _fail_mid_ring() -> None:
    """Rank 1 raises in the second step of the ring; the others are left waiting on it."""
    from mg_parallel.context_parallel import blocks

    real, calls = blocks.block_forward, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if dist.get_rank() == 1 and len(calls) == 2:
            raise RuntimeError("injected failure in the second ring step")
        return real(*args, **kwargs)

    blocks.block_forward = flaky
    try:
        grid = build_grid(ParallelDims(cp=WORLD))
        q = torch.randn(1, 4, 8, D, device=grid.device, requires_grad=True)
        context_parallel_attention(q, q, q, group=grid.cp_group, comm="p2p", causal=False).sum().backward()
        dist.barrier(group=grid.cp_group)
    finally:
        blocks.block_forward = real


LONG, LONG_HEADS = 16384, 4


def _saved_attention_bytes(q, k, v, group, comm):
    """Bytes of the distinct storages autograd keeps for backward during one attention forward."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = context_parallel_attention(q, k, v, group=group, comm=comm, causal=True)
    assert out.requires_grad
    return sum(storages.values())


def _long_inputs(cp, rank, device):
    gen = torch.Generator().manual_seed(5)
    whole = torch.randn(3, 1, LONG_HEADS, LONG, D, generator=gen)
    return [split_for_cp(t, rank, cp, seq_dim=2).to(device).requires_grad_(True) for t in whole]


def _saved_bytes_per_rank():
    """Forward only (the hooks see what backward would need) at cp 4 and at cp 2 (two groups side by side)."""
    found = {}
    for cp in (4, 2):
        grid = build_grid(ParallelDims(cp=cp))
        for comm in ("p2p", "allgather", "a2a"):
            found[(cp, comm)] = _saved_attention_bytes(*_long_inputs(cp, grid.cp_rank, grid.device), grid.cp_group, comm)
    return found


def test_saved_attention_activations_shrink_with_cp():
    """At 16k tokens each rank keeps 1/cp (within 10%) of the bytes one process keeps for attention's backward."""
    from mg_parallel.testing import run_distributed

    one = _saved_attention_bytes(*_long_inputs(1, 0, "cpu"), None, "p2p")
    q_bytes = LONG * LONG_HEADS * D * 4
    assert one < 6 * q_bytes, f"one process keeps {one} bytes: more than q, k, v, out and statistics at {LONG} tokens"
    for rank, found in enumerate(run_distributed(_saved_bytes_per_rank, WORLD)):
        for (cp, comm), n in found.items():
            assert abs(n * cp / one - 1) <= 0.1, f"rank {rank} cp={cp} {comm}: {n} bytes, 1/{cp} of {one} is {one / cp:.0f}"


def test_rank_failing_mid_ring_fails_the_job():
    """Kept last: the failure restarts the pool of this world size."""
    from mg_parallel.testing import RankFailed, RankTimeout, run_distributed

    with pytest.raises((RankFailed, RankTimeout), match="rank 1"):
        run_distributed(_fail_mid_ring, WORLD, timeout=20)
