"""MoE layer against a dense single-process reference written here, for ep 1/2/4, etp 2, cp and sp.

The reference sends every token to its top-k experts by explicit loops (and applies the capacity
rule by sorting each expert's assignments in Python); its load-balancing losses are computed from
their formulas. One ``run_distributed`` call per world size loops over every case, so a failure
names the rank and the case.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from mg_parallel.grid import ParallelDims, build_grid
from mg_parallel.moe import (
    GroupedExperts,
    MoEConfig,
    MoELayer,
    allreduce_expert_grads,
    expert_shard_info,
    keep_within_capacity,
    moe_losses,
)
from mg_parallel.tensor_parallel import shard_info
from mg_parallel.testing import run_distributed

TOL = {"rtol": 1e-5, "atol": 1e-5}
S, B, H, FFN, N, SHARED = 4, 2, 8, 12, 8, 10


# --- the dense reference ---------------------------------------------------------------------------


def _mlp(xt, w1, w2, act):
    if act == "swiglu":
        h = F.silu(xt @ w1[:, 0, :]) * (xt @ w1[:, 1, :])
    else:
        h = F.gelu(xt @ w1)
    return h @ w2


def _aux_stats(logits, cfg):
    """Counts of the unbiased top-k, summed full scores, by explicit loops."""
    full = torch.softmax(logits, -1) if cfg.moe_router_score_function == "softmax" else torch.sigmoid(logits)
    full = full / full.sum(-1, keepdim=True)
    top = torch.topk(full.detach(), cfg.moe_router_topk).indices
    counts = torch.zeros(N)
    for t in range(logits.shape[0]):
        for e in top[t].tolist():
            counts[e] += 1
    return counts, full


def _switch(counts, psum, tokens, cfg):
    f = counts / (tokens * cfg.moe_router_topk)
    return cfg.moe_aux_loss_coeff * N * (f * (psum / tokens)).sum()


def _reference(W, mbs, gouts, cfg, bias=None, aux_weight=1.0, z_weight=1.0):
    """Loss = sum over micro-batches of (out * gout).sum() + weighted aux (or the global one) and z losses."""
    k, act = cfg.moe_router_topk, cfg.moe_expert_activation
    kind = cfg.moe_router_load_balancing_type
    outs, total, global_counts, global_psum, global_tokens = [], 0.0, 0, 0, 0
    for x3, g in zip(mbs, gouts):
        x = x3.reshape(-1, H)
        T = x.shape[0]
        logits = x @ W["router"].T
        post = cfg.moe_router_score_function == "softmax" and not cfg.moe_router_pre_softmax
        scores = torch.sigmoid(logits) if cfg.moe_router_score_function == "sigmoid" else torch.softmax(logits, -1)
        chosen_by = (logits if post else scores) + (0 if bias is None else bias)
        idx = torch.topk(chosen_by.detach(), k).indices
        if post:
            probs = torch.softmax(logits.gather(1, idx), -1)
        else:
            probs = scores.gather(1, idx)
            if cfg.moe_router_norm_topk_prob:
                probs = probs / probs.sum(-1, keepdim=True)
        keep = [[True] * k for _ in range(T)]
        if cfg.moe_expert_capacity_factor is not None:
            cap = math.ceil(T * k / N * cfg.moe_expert_capacity_factor)
            for e in range(N):
                mine = sorted((-probs[t, j].item(), t, j) for t in range(T) for j in range(k) if idx[t, j] == e)
                for _, t, j in mine[cap:]:
                    keep[t][j] = False
        rows = []
        for t in range(T):
            y = torch.zeros(H)
            for j in range(k):
                if keep[t][j]:
                    e = idx[t, j].item()
                    y = y + probs[t, j] * _mlp(x[t], W["w1"][e], W["w2"][e], act)
            if "s_w1" in W:
                shared = _mlp(x[t], W["s_w1"][0], W["s_w2"][0], act)
                y = y + (torch.sigmoid(x[t] @ W["gate"][0]) * shared if "gate" in W else shared)
            rows.append(y)
        out = torch.stack(rows).view_as(x3)
        outs.append(out)
        total = total + (out * g).sum()
        if cfg.uses_aux_loss:
            counts, full = _aux_stats(logits, cfg)
            if kind == "aux_loss":
                total = total + aux_weight * _switch(counts, full.sum(0), T, cfg)
            elif kind == "seq_aux_loss":
                per_seq = []
                for j in range(x3.shape[1]):
                    tok = [t for t in range(T) if t % x3.shape[1] == j]
                    c, _ = _aux_stats(logits[tok], cfg)
                    per_seq.append(_switch(c, full[tok].sum(0), len(tok), cfg))
                total = total + aux_weight * torch.stack(per_seq).mean()
            else:
                global_counts, global_psum = global_counts + counts, global_psum + full.sum(0)
                global_tokens += T
        if cfg.uses_z_loss:
            total = total + z_weight * cfg.moe_z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
    if cfg.uses_aux_loss and kind == "global_aux_loss":
        total = total + aux_weight * _switch(global_counts, global_psum, global_tokens, cfg)
    return outs, total


def _ref_grads(weights, mbs, gouts, cfg, bias=None, aux_weight=1.0, z_weight=1.0):
    W = {n: w.detach().clone().requires_grad_(True) for n, w in weights.items()}
    xs = [x.detach().clone().requires_grad_(True) for x in mbs]
    outs, total = _reference(W, xs, gouts, cfg, bias, aux_weight, z_weight)
    total.backward()
    return [o.detach() for o in outs], {n: w.grad for n, w in W.items()}, [x.grad for x in xs], total.detach()


# --- the distributed side ----------------------------------------------------------------------


def _weights(cfg, gen):
    gated = cfg.moe_expert_activation == "swiglu"
    w = {"router": torch.randn(N, H, generator=gen),
         "w1": torch.randn(N, H, *((2,) if gated else ()), FFN, generator=gen) * 0.3,
         "w2": torch.randn(N, FFN, H, generator=gen) * 0.3}
    if cfg.moe_shared_expert_intermediate_size:
        w["s_w1"] = torch.randn(1, H, *((2,) if gated else ()), SHARED, generator=gen) * 0.3
        w["s_w2"] = torch.randn(1, SHARED, H, generator=gen) * 0.3
        if cfg.moe_shared_expert_gate:
            w["gate"] = torch.randn(1, H, generator=gen)
    return w


def _block(full, param, grid):
    shape, offset = expert_shard_info(param, tp_size=grid.tp_size, tp_rank=grid.tp_rank)
    assert tuple(full.shape) == shape
    return full[tuple(slice(o, o + n) for o, n in zip(offset, param.shape))]


def _build(weights, cfg, grid):
    copies = {tuple(weights["w1"].shape): weights["w1"], tuple(weights["w2"].shape): weights["w2"]}
    layer = MoELayer(H, FFN, N, cfg, grid, init_method=lambda w: w.copy_(copies[tuple(w.shape)]))
    with torch.no_grad():
        layer.router.weight.copy_(weights["router"])
        if layer.shared_experts is not None:
            for name in ("w1", "w2"):
                p = getattr(layer.shared_experts, name)
                shape, offset = shard_info(p, grid)
                p.copy_(weights[f"s_{name}"][tuple(slice(o, o + n) for o, n in zip(offset, p.shape))])
            if layer.shared_gate is not None:
                layer.shared_gate.weight.copy_(weights["gate"])
    return layer


def _gathered(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


_GRIDS = {}  # per worker process: creating groups is a collective, so build each layout once


def _grid(**dims):
    key = tuple(sorted(dims.items()))
    if key not in _GRIDS:
        _GRIDS[key] = build_grid(ParallelDims(**dims))
    return _GRIDS[key]


def _run_case(layout, dims, cfg, seed, bias=None, idle=None):
    grid = _grid(**dims)
    case = f"{layout} {dims} {cfg}"
    gen = torch.Generator().manual_seed(seed)
    weights = _weights(cfg, gen)
    n_mb = grid.dp_size
    xs = torch.randn(n_mb, S, B, H, generator=gen)
    gouts = torch.randn(n_mb, S, B, H, generator=gen)
    layer = _build(weights, cfg, grid)
    if bias is not None:
        layer.router.expert_bias.copy_(bias)
    split = {"cp": (grid.cp_size, grid.cp_rank), "sp": (grid.tp_size, grid.tp_rank),
             "sp_etp": (grid.tp_size, grid.tp_rank)}.get(layout, (1, 0))
    mine = xs[grid.dp_rank].chunk(split[0])[split[1]]
    g_mine = gouts[grid.dp_rank].chunk(split[0])[split[1]]
    x = mine.clone().requires_grad_(True)
    out = layer(x)
    (out * g_mine).sum().backward()
    mb = grid.dp_rank
    # Gradients are averaged over cp and dp ranks, so each rank's objective is its output term plus its
    # estimate of the loss: its share times the cp (and, global, dp) ranks the loss spans.
    weight = {"aux_weight": grid.cp_size * (grid.dp_size if layout == "global" else 1), "z_weight": grid.cp_size}
    own_outs, own, own_x, own_loss = _ref_grads(weights, [xs[mb]], [gouts[mb]], cfg, bias, **weight)
    if layout == "global":  # one loss over every rank's tokens: its input gradient on each rank
        own_x = [_ref_grads(weights, list(xs), list(gouts), cfg, **weight)[2][mb]]
    msg = lambda what: lambda m: f"rank {grid.rank} {case} {what}: {m}"  # noqa: E731
    assert_close(out, own_outs[0].chunk(split[0])[split[1]], **TOL, msg=msg("output"))
    assert_close(x.grad, own_x[0].chunk(split[0])[split[1]], **TOL, msg=msg("input grad"))
    if layout in ("dp", "global"):  # each rank's own micro-batch; its experts also serve its ep peers
        # the losses are per micro-batch (for the experts' weights the global one too): grads add up
        peers = [_ref_grads(weights, [xs[m]], [gouts[m]], cfg, bias)[1] if m != mb else own
                 for m in (grid.dims.coords(r)["dp"] for r in grid.ep_ranks)]
        group = {name: sum(p[name] for p in peers) for name in ("w1", "w2")}
        router_grad, expected = layer.router.weight.grad, own["router"]
        if layout == "global":  # one loss over every rank's tokens: the ranks' shares add up to its gradient
            router_grad = sum(_gathered(router_grad))
            expected = _ref_grads(weights, list(xs), list(gouts), cfg, **weight)[1]["router"]
        assert_close(router_grad, expected, **TOL, msg=msg("router grad"))
    else:
        group = own
        router_grad = layer.router.weight.grad
        if layout in ("cp", "sp"):  # each rank's share of the micro-batch: the shares add up
            router_grad = sum(_gathered(router_grad))
        assert_close(router_grad, own["router"], **TOL, msg=msg("router grad"))
    for name in ("w1", "w2"):
        p = getattr(layer.experts, name)
        grad = sum(_gathered(p.grad)) if layout == "sp" else p.grad
        assert_close(grad, _block(group[name], p, grid), **TOL, msg=msg(f"expert {name} grad"))
        if layer.shared_experts is not None and layout == "dp":
            sp_ = getattr(layer.shared_experts, name)
            assert_close(sp_.grad, own[f"s_{name}"], **TOL, msg=msg(f"shared {name} grad"))
    if idle is not None:  # a never-chosen expert gets zero (not missing) gradients
        local = idle - grid.ep_rank * layer.experts.num_local_experts
        if 0 <= local < layer.experts.num_local_experts:
            assert layer.experts.w1.grad[local].abs().max() == 0 and layer.experts.w2.grad[local].abs().max() == 0
    losses = moe_losses(layer)
    if cfg.uses_aux_loss and layout in ("dp", "cp"):
        counts, full = _aux_stats(xs[mb].reshape(-1, H) @ weights["router"].T, cfg)
        if cfg.moe_router_load_balancing_type == "aux_loss":
            assert_close(losses["load_balancing_loss"], _switch(counts, full.sum(0), S * B, cfg), **TOL)
    return case


def _cases_world4():
    base = dict(moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    out = []
    for ep in (1, 2, 4):
        out.append(("dp", dict(ep=ep), MoEConfig(**base), 10 + ep))
    out.append(("dp", dict(ep=4), MoEConfig(**base, moe_grouped_gemm=True), 15))  # grouped_mm (auto is the loop on CPU)
    out += [
        ("dp", dict(ep=4), MoEConfig(**base, moe_token_dispatcher_type="allgather"), 21),
        ("dp", dict(ep=2), MoEConfig(**base, moe_expert_capacity_factor=0.5), 22),
        ("dp", dict(ep=4), MoEConfig(**base, moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True), 23),
        ("dp", dict(ep=2), MoEConfig(**base, moe_expert_capacity_factor=0.75, moe_token_dispatcher_type="allgather"), 24),
        ("dp", dict(ep=2), MoEConfig(moe_router_topk=3, moe_router_score_function="sigmoid", moe_router_norm_topk_prob=True,
                                    moe_expert_activation="gelu", moe_aux_loss_coeff=0.1,
                                    moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_gate=True), 25),
        ("dp", dict(ep=4), MoEConfig(**base, moe_router_pre_softmax=True, moe_router_norm_topk_prob=True,
                                    moe_router_load_balancing_type="seq_aux_loss",
                                    moe_shared_expert_intermediate_size=SHARED), 26),
    ]
    return out


def _check_world4():
    cases = [_run_case(*c) for c in _cases_world4()]
    idle_bias = torch.zeros(N)
    idle_bias[5] = -1e4  # expert 5 is never chosen
    for grouped in (None, True):
        cfg = MoEConfig(moe_router_topk=2, moe_router_enable_expert_bias=True, moe_grouped_gemm=grouped)
        cases.append(_run_case("dp", dict(ep=4), cfg, 30, bias=idle_bias, idle=5))
    cases.append(_check_expert_grad_average())
    cases.append(_check_ddp_experts())
    return cases


def _check_expert_grad_average():
    """ep 2 of dp 4: averaged over the expert-dp group, expert grads are the mean over all 4 micro-batches."""
    grid = _grid(ep=2)
    cfg = MoEConfig(moe_router_topk=2)
    gen = torch.Generator().manual_seed(60)
    weights = _weights(cfg, gen)
    xs, gouts = torch.randn(4, S, B, H, generator=gen), torch.randn(4, S, B, H, generator=gen)
    layer = _build(weights, cfg, grid)
    (layer(xs[grid.rank]) * gouts[grid.rank]).sum().backward()
    allreduce_expert_grads([layer], grid)
    _, ref, _, _ = _ref_grads(weights, list(xs), list(gouts), cfg)
    for name in ("w1", "w2"):
        p = getattr(layer.experts, name)
        assert_close(p.grad, _block(ref[name], p, grid) / 4, **TOL)
    return "expert grad average"


def _check_ddp_experts():
    """ep 2 of dp 4 under DDP, with and without the distributed optimizer: expert gradients are the mean over
    all 4 micro-batches (their own buffers, reduced over the expert-data-parallel group), the router's the dp
    mean, and each counts once in the optimizer's gradient norm."""
    from mg_parallel.distributed import DistributedDataParallel, finalize_model_grads, grad_of
    from mg_parallel.optimizer import OptimizerConfig, build_optimizer

    grid = _grid(ep=2)
    cfg = MoEConfig(moe_router_topk=2, moe_aux_loss_coeff=0.1)
    gen = torch.Generator().manual_seed(61)
    weights = _weights(cfg, gen)
    xs, gouts = torch.randn(4, S, B, H, generator=gen), torch.randn(4, S, B, H, generator=gen)
    _, ref, _, _ = _ref_grads(weights, list(xs), list(gouts), cfg)
    want_norm = float(sum((ref[k] / 4).square().sum() for k in ("router", "w1", "w2")).sqrt())
    for distributed in (False, True):
        ddp = DistributedDataParallel(_build(weights, cfg, grid), grid, use_distributed_optimizer=distributed)
        opt = build_optimizer([ddp], grid, OptimizerConfig(lr=0.0, use_distributed_optimizer=distributed))
        (ddp(xs[grid.rank]) * gouts[grid.rank]).sum().backward()
        finalize_model_grads([ddp], grid)
        if not distributed:  # (with it, only this rank's shard of each bucket is reduced)
            layer = ddp.module
            assert_close(grad_of(layer.router.weight), ref["router"] / 4, **TOL)
            for name in ("w1", "w2"):
                p = getattr(layer.experts, name)
                assert_close(grad_of(p), _block(ref[name], p, grid) / 4, **TOL)
        _, norm = opt.step()
        assert norm == pytest.approx(want_norm, rel=1e-5), (distributed, norm, want_norm)
    return "ddp experts"


def _check_world2():
    base = dict(moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    cases = [
        ("cp", dict(cp=2, ep=2), MoEConfig(**base), 40),
        ("cp", dict(cp=2, ep=2), MoEConfig(**base, moe_router_load_balancing_type="seq_aux_loss"), 41),
        ("global", dict(ep=2), MoEConfig(**base, moe_router_load_balancing_type="global_aux_loss"), 42),
        ("global", dict(ep=1), MoEConfig(**base, moe_router_load_balancing_type="global_aux_loss"), 43),
        ("tp_etp", dict(tp=2, etp=2), MoEConfig(**base), 44),
        ("sp_etp", dict(tp=2, etp=2, sequence_parallel=True), MoEConfig(**base, moe_shared_expert_intermediate_size=SHARED), 45),
        ("sp", dict(tp=2, sequence_parallel=True), MoEConfig(**base, moe_router_load_balancing_type="seq_aux_loss"), 46),
    ]
    names = [_run_case(*c) for c in cases]
    names.append(_check_bias_update())
    return names


def _check_bias_update():
    """Two dp ranks route their own tokens; the bias moves by rate * sign(mean load - load) of their sum."""
    grid = _grid(ep=2)
    cfg = MoEConfig(moe_router_topk=2, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01)
    layer = MoELayer(H, FFN, N, cfg, grid)
    torch.manual_seed(0)  # the same router on both ranks
    with torch.no_grad():
        layer.router.weight.normal_()
    start = torch.linspace(-0.05, 0.05, N)
    layer.router.expert_bias.copy_(start)
    gen = torch.Generator().manual_seed(50)
    xs = torch.randn(2, 3, S, B, H, generator=gen)
    counts = torch.zeros(N)
    for step in range(3):  # three micro-batches between updates
        layer(xs[grid.rank, step]).sum().backward()
        for r in range(2):
            chosen = torch.topk(xs[r, step].reshape(-1, H) @ layer.router.weight.detach().T + start, 2).indices
            counts += torch.bincount(chosen.flatten(), minlength=N).float()
    layer.router.update_expert_bias()
    assert_close(layer.router.expert_bias, start + 0.01 * torch.sign(counts.mean() - counts), rtol=0, atol=1e-7)
    assert layer.router.local_tokens_per_expert.abs().sum() == 0
    return "bias update"


@pytest.mark.parametrize("world, fn", [(4, _check_world4), (2, _check_world2)])
def test_moe_layer_matches_dense_reference(world, fn):
    results = run_distributed(fn, world, timeout=180)
    assert all(r == results[0] for r in results)


def test_single_process_layer_and_losses():
    for cfg in (MoEConfig(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01),
                MoEConfig(moe_router_topk=1, moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.2)):
        gen = torch.Generator().manual_seed(1)
        weights = _weights(cfg, gen)
        from mg_parallel.grid import ProcessGrid
        layer = _build(weights, cfg, ProcessGrid.single())
        x = torch.randn(S, B, H, generator=gen)
        g = torch.randn(S, B, H, generator=gen)
        x_leaf = x.clone().requires_grad_(True)
        (layer(x_leaf) * g).sum().backward()
        outs, grads, xg, _ = _ref_grads(weights, [x], [g], cfg)
        assert_close(layer.router.weight.grad, grads["router"], **TOL)
        assert_close(x_leaf.grad, xg[0], **TOL)
        logits = x.reshape(-1, H) @ weights["router"].T
        losses = moe_losses(layer)
        if cfg.moe_router_load_balancing_type == "seq_aux_loss":
            per_seq = []
            for j in range(B):
                c, full = _aux_stats(logits[j::B], cfg)
                per_seq.append(_switch(c, full.sum(0), S, cfg))
            assert_close(losses["load_balancing_loss"], torch.stack(per_seq).mean(), **TOL)
        else:
            c, full = _aux_stats(logits, cfg)
            assert_close(losses["load_balancing_loss"], _switch(c, full.sum(0), S * B, cfg), **TOL)
            assert_close(losses["z_loss"], 0.01 * torch.logsumexp(logits, -1).square().mean(), **TOL)


def test_capacity_rule_ties_go_to_the_lower_token():
    indices = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])
    probs = torch.tensor([[0.5, 0.5], [0.6, 0.4], [0.5, 0.5], [0.7, 0.3]])
    keep = keep_within_capacity(indices, probs, 3, capacity=2)
    # expert 0: token 1 (0.6), then tokens 0 and 2 tie at 0.5 -> token 0; token 3 (0.3) dropped
    # expert 1: token 3 (0.7), token 0 (0.5); token 1 (0.4) dropped
    assert keep.tolist() == [[True, True], [True, False], [False, True], [True, False]]


def test_validation_names_the_fields():
    with pytest.raises(ValueError, match=r"model.num_experts=6 is not divisible by parallel.ep=4"):
        GroupedExperts(6, H, FFN, ep_size=4)
    with pytest.raises(ValueError, match="moe_router_load_balancing_type"):
        MoEConfig(moe_router_load_balancing_type="sinkhorn")
    with pytest.raises(ValueError, match="moe_pad_expert_input_to_capacity"):
        MoEConfig(moe_pad_expert_input_to_capacity=True)
    with pytest.raises(ValueError, match="moe_expert_capacity_factor"):
        MoEConfig(moe_expert_capacity_factor=0.0)
    with pytest.raises(ValueError, match="moe_router_topk=3 exceeds model.num_experts=2"):
        MoELayer(H, FFN, 2, MoEConfig(moe_router_topk=3))


@pytest.mark.parametrize("grouped", [False, True])
def test_experts_in_bf16_and_under_autocast(grouped):
    """Both expert paths in bf16 (bf16 weights, or fp32 weights under CPU autocast) against the fp32 products
    of the same bf16-rounded values, per expert by a loop, including an expert that gets no row."""
    gen = torch.Generator().manual_seed(7)
    h, f = 16, 32  # 16-byte aligned rows for _grouped_mm in bf16
    counts = torch.tensor([3, 0, 5, 2, 4, 1, 6, 3])
    for autocast in (False, True):
        experts = GroupedExperts(N, h, f, grouped=grouped)
        if not autocast:
            experts = experts.to(torch.bfloat16)
        with torch.no_grad():  # values exact in bf16, so both sides start from the same numbers
            for p in experts.parameters():
                p.copy_(torch.randn(p.shape, generator=gen).mul_(0.3).bfloat16())
        x = torch.randn(int(counts.sum()), h, generator=gen).bfloat16().requires_grad_(True)
        g = torch.randn(x.shape, generator=gen).bfloat16()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = experts(x, counts)
        assert y.dtype == torch.bfloat16 and experts.path == ("grouped_mm" if grouped else "loop")
        (y.float() * g.float()).sum().backward()
        w1, w2 = (p.detach().float().requires_grad_(True) for p in (experts.w1, experts.w2))
        xr = x.detach().float().requires_grad_(True)
        ref = torch.cat([_mlp(xe, w1[e], w2[e], "swiglu") for e, xe in enumerate(xr.split(counts.tolist()))])
        (ref * g.float()).sum().backward()
        tol = {"rtol": 1e-2, "atol": 1e-2 * ref.abs().max().item()}
        assert_close(y.float(), ref, **tol)
        assert_close(x.grad.float(), xr.grad, rtol=1e-2, atol=1e-2 * xr.grad.abs().max().item())
        for p, r in ((experts.w1, w1), (experts.w2, w2)):
            assert p.grad.dtype == p.dtype
            assert_close(p.grad.float(), r.grad, rtol=1e-2, atol=1e-2 * r.grad.abs().max().item())
        assert experts.w1.grad[1].abs().max() == 0 and experts.w2.grad[1].abs().max() == 0
