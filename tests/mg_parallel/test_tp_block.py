"""A 2-layer transformer (attention + MLP) built from the tensor-parallel layers equals the
same model built from plain nn.Linear / nn.LayerNorm in one process: outputs and every grad,
at tp=2 with and without sequence parallelism.

The two model classes here are also used by the recompute tests.
"""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from mg_parallel.grid import ParallelDims, build_grid
from mg_parallel.recompute import RecomputeConfig, recompute
from mg_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    allreduce_sequence_parallel_grads,
    gather_from_sequence_parallel_region,
    mark_sequence_parallel,
    scatter_to_sequence_parallel_region,
)

S, B, H, HEADS, FFN, LAYERS = 8, 2, 16, 4, 32, 2


def core_attention(qkv: torch.Tensor, heads: int, dropout: float, training: bool, rng_ctx) -> torch.Tensor:
    """Causal attention of a fused ``[s, b, heads * 3 * hd]`` projection -> ``[s, b, heads * hd]``."""
    s, b, _ = qkv.shape
    q, k, v = qkv.view(s, b, heads, 3, -1).permute(3, 1, 2, 0, 4)  # 3 x (b, nh, s, hd)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (b, nh, s, s)
    causal = torch.ones(s, s, dtype=torch.bool, device=qkv.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    with rng_ctx():
        # Each rank holds different heads: their dropout masks must differ.
        probs = F.dropout(probs, dropout, training)
    out = probs @ v  # (b, nh, s, hd)
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class RefLayer(nn.Module):
    """Pre-norm transformer layer on plain modules (the single-process reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc1, self.fc2 = nn.Linear(H, FFN), nn.Linear(FFN, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(core_attention(self.qkv(self.ln1(x)), HEADS, 0.0, False, contextlib.nullcontext))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ParallelLayer(nn.Module):
    """The same layer with column/row-parallel projections (heads and FFN split over tp)."""

    def __init__(self, tp_group, sequence_parallel: bool, dropout: float = 0.0, rng_tracker=None,
                 recompute_attention: bool = False) -> None:
        super().__init__()
        tp = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
        kw = {"tp_group": tp_group, "sequence_parallel": sequence_parallel}
        self.sp, self.dropout, self.tracker = sequence_parallel, dropout, rng_tracker
        self.heads = HEADS // tp
        self.recompute_attention = recompute_attention
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        if sequence_parallel:
            mark_sequence_parallel(self.ln1)
            mark_sequence_parallel(self.ln2)
        self.qkv, self.proj = ColumnParallelLinear(H, 3 * H, **kw), RowParallelLinear(H, H, **kw)
        self.fc1, self.fc2 = ColumnParallelLinear(H, FFN, **kw), RowParallelLinear(FFN, H, **kw)

    def _fork(self):
        return self.tracker.fork() if self.tracker is not None else contextlib.nullcontext()

    def _hidden_dropout(self, x: torch.Tensor) -> torch.Tensor:
        # Replicated activations share the default stream; sequence shards need the forked one.
        with self._fork() if self.sp else contextlib.nullcontext():
            return F.dropout(x, self.dropout, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x))
        args = (qkv, self.heads, self.dropout, self.training, self._fork)
        if self.recompute_attention:
            attn = recompute(core_attention, *args, rng_tracker=self.tracker)
        else:
            attn = core_attention(*args)
        x = x + self._hidden_dropout(self.proj(attn))
        return x + self._hidden_dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class ParallelModel(nn.Module):
    """``LAYERS`` parallel layers on ``[s, b, h]`` input; sequence-parallel inside when asked."""

    def __init__(self, tp_group, sequence_parallel: bool, dropout: float = 0.0, rng_tracker=None,
                 recompute_cfg: RecomputeConfig | None = None) -> None:
        super().__init__()
        self.tp_group, self.sp, self.tracker = tp_group, sequence_parallel, rng_tracker
        self.cfg = recompute_cfg or RecomputeConfig()
        self.layers = nn.ModuleList(
            ParallelLayer(tp_group, sequence_parallel, dropout, rng_tracker, self.cfg.recompute_core_attention)
            for _ in range(LAYERS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        for i, layer in enumerate(self.layers):
            x = recompute(layer, x, rng_tracker=self.tracker) if self.cfg.recompute_layer(i) else layer(x)
        if self.sp:
            # The output feeds a loss computed identically on every rank: split, don't sum, in backward.
            x = gather_from_sequence_parallel_region(x, self.tp_group, tensor_parallel_output_grad=False)
        return x


def load_from_reference(model: ParallelModel, ref_layers: nn.ModuleList) -> None:
    """Copy the reference weights into the parallel model (each rank keeps its shard)."""
    for layer, ref in zip(model.layers, ref_layers):
        with torch.no_grad():
            for name in ("ln1", "ln2"):
                getattr(layer, name).load_state_dict(getattr(ref, name).state_dict())
            for name in ("qkv", "proj", "fc1", "fc2"):
                mine, full = getattr(layer, name), getattr(ref, name)
                dim = mine.weight.partition_dim
                tp, rank = _tp(model.tp_group)
                mine.weight.copy_(full.weight.chunk(tp, dim=dim)[rank])
                mine.bias.copy_(full.bias.chunk(tp)[rank] if dim == 0 else full.bias)


def _tp(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def _check_block(tp: int, sp: bool) -> str:
    grid = build_grid(ParallelDims(tp=tp))
    torch.manual_seed(5)
    ref = nn.ModuleList(RefLayer() for _ in range(LAYERS))
    with torch.no_grad():
        for p in ref.parameters():  # make the LayerNorm and bias values non-trivial too
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(S, B, H)
    grad_out = torch.randn(S, B, H)
    x_ref = x.clone().requires_grad_(True)
    y_ref = x_ref
    for layer in ref:
        y_ref = layer(y_ref)
    (y_ref * grad_out).sum().backward()

    model = ParallelModel(grid.tp_group, sp)
    load_from_reference(model, ref)
    x_par = x.clone().requires_grad_(True)
    y = model(x_par)
    tol = {"rtol": 1e-5, "atol": 1e-5}
    case = f"block tp={tp} sp={sp}"
    assert_close(y, y_ref.detach(), **tol, msg=lambda m: f"{case} output: {m}")
    (y * grad_out).sum().backward()
    allreduce_sequence_parallel_grads(model, grid.tp_group)
    assert_close(x_par.grad, x_ref.grad, **tol, msg=lambda m: f"{case} input grad: {m}")
    tp_, rank = _tp(grid.tp_group)
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
        expect = p_ref.grad
        if getattr(p, "tensor_parallel", False):
            expect = expect.chunk(tp_, dim=p.partition_dim)[rank]
        assert_close(p.grad, expect, **tol, msg=lambda m, name=name: f"{case} grad of {name}: {m}")
    return "ok"


def _check_blocks(tp: int) -> list[str]:
    return [_check_block(tp, sp) for sp in (False, True)]


@pytest.mark.parametrize("world", [1, 2])
def test_transformer_block_matches_single_process(world):
    from mg_parallel.testing import run_distributed

    assert run_distributed(_check_blocks, world, world) == [["ok", "ok"]] * world
