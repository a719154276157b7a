"""Every matmul of the parallel layers, the experts and the router goes through the layer's GEMM recipe.

A counting recipe is set on the layers, and a ``TorchFunctionMode`` independently records every matmul-family
torch call made forward and backward (:mod:`tests.mg_parallel.gemm_audit`): none may happen outside a recipe
call, and the recipe's calls must be the number the layers' structure gives.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mg_parallel import Precision
from mg_parallel.gemm import PLAIN_GEMM, Gemm, use_gemm
from mg_parallel.grid import ParallelDims, build_grid
from mg_parallel.moe import GroupedExperts, MoEConfig, MoELayer, TopKRouter, grouped_mm_supported
from mg_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    chunked_vocab_parallel_cross_entropy,
    scatter_to_sequence_parallel_region,
)
from mg_parallel.testing import run_distributed
from tests.mg_parallel.gemm_audit import CountingGemm, MatmulAudit

S, B, H, FFN, LAYERS, EXPERTS = 4, 2, 8, 16, 3, 4


class _Stack(nn.Module):
    """``LAYERS`` MLP blocks ``x + fc2(gelu(fc1(x)))`` of column- and row-parallel linears."""

    def __init__(self, tp_group=None, *, sequence_parallel=False, async_grad_allreduce=True, gemm=PLAIN_GEMM) -> None:
        super().__init__()
        kw = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, gemm=gemm)
        self.blocks = nn.ModuleList(
            nn.ModuleList([ColumnParallelLinear(H, FFN, async_grad_allreduce=async_grad_allreduce, **kw),
                           RowParallelLinear(FFN, H, **kw)])
            for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc1, fc2 in self.blocks:
            x = x + fc2(F.gelu(fc1(x)))
        return x


def _audited(module: nn.Module, recipe: CountingGemm, step) -> MatmulAudit:
    """Run ``step()`` (forward and backward) under the audit; check nothing escaped the recipe."""
    with MatmulAudit(recipe) as audit:
        step()
    assert not audit.outside, f"matmuls outside the GEMM recipe: {audit.outside}"
    # the plain counting recipe makes one torch matmul per call: the audit saw each of them inside
    assert sum(audit.inside.values()) == sum(recipe.calls.values()) > 0
    return audit


def test_audit_sees_a_matmul_outside_the_recipe():
    recipe, lin = CountingGemm(), nn.Linear(H, H)
    x = torch.randn(S, H, requires_grad=True)

    class _Escaping(torch.autograd.Function):  # a backward matmul written without the recipe
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return torch.mm(g, torch.eye(H)) * 2

    with MatmulAudit(recipe) as audit:
        (lin(_Escaping.apply(x)) @ torch.ones(H)).sum().backward()
    assert [site.split(" ")[0] for site in audit.outside] == ["linear", "matmul", "mm"], audit.outside
    assert all("test_gemm.py" in site for site in audit.outside), audit.outside


def test_plain_mm_is_the_fold_matmul_makes():
    """The column-parallel backward multiplies ``[s*b, out] @ [out, in]`` where it called ``matmul`` on
    ``[s, b, out]``: the same bits, contiguous or not."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(FFN, H, generator=gen)
    for g in (torch.randn(S, B, FFN, generator=gen), torch.randn(B, S, FFN, generator=gen).transpose(0, 1)):
        folded = PLAIN_GEMM.mm(g.reshape(-1, FFN), w).view(S, B, H)
        assert torch.equal(folded, g.matmul(w))


def test_tp_layers_and_chunked_loss_single_process():
    torch.manual_seed(0)
    model, recipe = _Stack(), CountingGemm()
    assert use_gemm(model, recipe) == 2 * LAYERS
    assert all(m.gemm is recipe for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear)))
    vocab_weight = torch.randn(24, H, requires_grad=True)
    target = torch.randint(0, 24, (S * B,))
    chunk = 3
    chunks = -(-S * B // chunk)

    def step():
        hidden = model(torch.randn(S, B, H, requires_grad=True)).reshape(-1, H)
        chunked_vocab_parallel_cross_entropy(hidden, vocab_weight, target, chunk_tokens=chunk, gemm=recipe).sum(
        ).backward()

    _audited(model, recipe, step)
    # each linear once forward (autograd differentiates F.linear); each loss chunk projected forward and again
    # in backward, then its two gradient products
    assert recipe.calls == {"linear": 2 * LAYERS + 2 * chunks, "mm": 2 * chunks}


def test_use_gemm_filter_and_default():
    model = _Stack()
    assert all(m.gemm is PLAIN_GEMM for m in model.modules() if hasattr(m, "gemm"))
    recipe = CountingGemm()
    assert use_gemm(model, recipe, where=lambda name, m: isinstance(m, RowParallelLinear)) == LAYERS
    assert [type(m.gemm) for fc1, fc2 in model.blocks for m in (fc1, fc2)] == [Gemm, CountingGemm] * LAYERS
    with pytest.raises(TypeError, match="Gemm recipe"):
        use_gemm(model, lambda x, w: x @ w.T)


def test_precision_carries_its_recipe():
    assert Precision.from_name("bf16").gemm is PLAIN_GEMM
    recipe = CountingGemm()
    policy = Precision.from_name("fp32", gemm=recipe)
    assert policy.gemm is recipe and policy.param_dtype == torch.float32
    model = _Stack()
    assert use_gemm(model, policy.gemm) == 2 * LAYERS
    model(torch.randn(S, B, H))
    assert recipe.calls == {"linear": 2 * LAYERS}


def _tp2_cases() -> dict[str, tuple[dict, list, int]]:
    """Each tp=2 layout forward and backward under the audit: (recipe calls, matmuls outside, inside count)."""
    grid = build_grid(ParallelDims(tp=2))
    out = {}
    for case, kw in {"async": {}, "sequence_parallel": {"sequence_parallel": True},
                     "sync": {"async_grad_allreduce": False}}.items():
        torch.manual_seed(0)
        recipe = CountingGemm()
        model = _Stack(grid.tp_group, gemm=recipe, **kw)
        x = torch.randn(S, B, H)
        if kw.get("sequence_parallel"):
            x = scatter_to_sequence_parallel_region(x, grid.tp_group)
        x.requires_grad_(True)
        with MatmulAudit(recipe) as audit:
            model(x).square().sum().backward()
        out[case] = (dict(recipe.calls), audit.outside, sum(audit.inside.values()))
    return out


def test_tp_layers_tp2():
    for rank, cases in enumerate(run_distributed(_tp2_cases, 2)):
        for case, (calls, outside, inside) in cases.items():
            assert not outside, f"rank {rank} {case}: matmuls outside the recipe: {outside}"
            # forward: one linear per layer; the fused column-parallel function's backward: input and weight
            # gradients through mm (the unfused path leaves F.linear's backward to autograd)
            fused = case != "sync"
            want = {"linear": 2 * LAYERS, **({"mm": 2 * LAYERS} if fused else {})}
            assert calls == want, (rank, case, calls)
            assert inside == sum(calls.values()), (rank, case)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("path", ["loop", "grouped_mm"])
def test_experts(path, activation):
    gated = activation == "swiglu"
    if path == "grouped_mm" and not (grouped_mm_supported(H, (2 if gated else 1) * FFN, torch.float32, "cpu")
                                     and grouped_mm_supported(FFN, H, torch.float32, "cpu")):
        pytest.skip("torch._grouped_mm does not run forward and backward on this CPU build")
    torch.manual_seed(0)
    recipe = CountingGemm()
    experts = GroupedExperts(EXPERTS, H, FFN, activation=activation, grouped=path == "grouped_mm", gemm=recipe)
    assert experts.path == path
    counts = torch.tensor([3, 0, 4, 2])  # an idle expert still gets its (zero) weight-gradient product
    x = torch.randn(int(counts.sum()), H, requires_grad=True)
    _audited(experts, recipe, lambda: experts(x, counts).square().sum().backward())
    # loop: per expert two products forward, four backward (input and weight gradients of each projection);
    # grouped: one grouped product per projection (autograd differentiates it)
    assert recipe.calls == ({"mm": 6 * EXPERTS} if path == "loop" else {"grouped_mm": 2})
    assert x.grad is not None and experts.w1.grad is not None


def test_router_and_moe_layer():
    torch.manual_seed(0)
    cfg = MoEConfig(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, moe_shared_expert_intermediate_size=FFN,
                    moe_shared_expert_gate=True, moe_grouped_gemm=False)
    layer = MoELayer(H, FFN, EXPERTS, cfg)
    recipe = CountingGemm()
    # router, routed experts, shared expert, shared expert's gate
    assert use_gemm(layer, recipe) == 4
    _audited(layer, recipe, lambda: layer(torch.randn(S, B, H, requires_grad=True)).square().sum().backward())
    # router and gate: one linear each; routed experts and the one shared expert: 6 products each (loop path)
    assert recipe.calls == {"linear": 2, "mm": 6 * EXPERTS + 6}

    router, alone = TopKRouter(H, EXPERTS, cfg), CountingGemm()
    assert use_gemm(router, alone) == 1
    _audited(router, alone, lambda: router(torch.randn(S * B, H, requires_grad=True))[0].sum().backward())
    assert alone.calls == {"linear": 1}
