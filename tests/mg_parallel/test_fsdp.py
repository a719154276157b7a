"""FSDP2 through apply_fsdp: training parity against one process (dp2, dp4, HSDP 2x2, tp2 x dp2, gradient
accumulation, clipping, a tied embedding, CPU offload, a schedule driving the micro-batches), memory per rank,
and the configuration errors."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mg_parallel.distributed import (
    apply_fsdp,
    check_fsdp,
    clip_fsdp_grads,
    finalize_fsdp_grads,
    memory_bytes,
    no_gradient_sync,
)
from mg_parallel.grid import ParallelDims, build_grid
from mg_parallel.pipeline import forward_backward_no_pipelining
from mg_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, mark_replicated
from mg_parallel.testing import run_distributed

V, H, FFN, LAYERS, S, B = 32, 16, 64, 3, 4, 8
LR, WD, CLIP, STEPS, TOL = 1e-2, 0.1, 0.5, 5, 2e-5


class Block(nn.Module):
    """Pre-norm MLP block; fc1/fc2 are column/row-parallel (plain F.linear at tp_group=None)."""

    def __init__(self, w: dict[str, torch.Tensor], i: int, tp_group) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        mark_replicated(self.norm)
        self.fc1 = ColumnParallelLinear(H, FFN, tp_group=tp_group, init_method=lambda t: t.copy_(w[f"fc1.{i}"]))
        self.fc2 = RowParallelLinear(FFN, H, tp_group=tp_group, init_method=lambda t: t.copy_(w[f"fc2.{i}"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Embedding, LAYERS blocks, final norm, output head tied to the embedding; forward returns mean CE."""

    def __init__(self, tp_group=None, tied: bool = True) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        w = {f"{n}.{i}": torch.randn(shape, generator=g) * 0.3
             for i in range(LAYERS) for n, shape in (("fc1", (FFN, H)), ("fc2", (H, FFN)))}
        self.emb = nn.Embedding(V, H)
        self.layers = nn.ModuleList(Block(w, i, tp_group) for i in range(LAYERS))
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(V, H, generator=g))
            self.head.weight.copy_(torch.randn(V, H, generator=g) * 0.3)
        if tied:
            self.head.weight = self.emb.weight
        mark_replicated(self.emb, self.norm, self.head)

    def forward(self, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)  # [b, s, h]
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), target.flatten())


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)) for _ in range(steps)]


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)


def reference(tied: bool = True, clip: float = CLIP) -> list[dict[str, torch.Tensor]]:
    """One process, the full batch: parameters after each step."""
    model = Net(tied=tied)
    opt = adamw(model)
    out = []
    for tokens, target in batches():
        opt.zero_grad()
        model(tokens, target).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def train_fsdp(dp: int, *, tp: int = 1, shard_size: int | None = None, micro: int = 2, tied: bool = True,
               clip: float = CLIP, offload: bool = False, schedule: bool = False) -> list[dict[str, torch.Tensor]]:
    """Train under apply_fsdp on this rank's share of each batch; returns the tp-local full parameters per step."""
    grid = build_grid(ParallelDims(tp=tp))
    assert grid.dp_size == dp
    model = apply_fsdp(Net(grid.tp_group, tied), grid, "fp32", shard_size=shard_size, offload=offload)
    opt = adamw(model)
    per_rank = B // dp
    out = []
    for tokens, target in batches():
        opt.zero_grad()
        mine = slice(grid.dp_rank * per_rank, (grid.dp_rank + 1) * per_rank)
        micros = list(zip(tokens[mine].chunk(micro), target[mine].chunk(micro)))
        if schedule:  # the pipeline package's micro-batch loop drives forward and backward
            forward_backward_no_pipelining(lambda b, m: (m(*b), lambda loss: (loss, {})), iter(micros), [model],
                                           micro, grid, tensor_shape=(1,), finalize_grads=finalize_fsdp_grads)
        else:
            for i, (x, t) in enumerate(micros):
                with no_gradient_sync(model) if i < micro - 1 else torch.enable_grad():
                    (model(x, t) / micro).backward()
        if clip:
            clip_fsdp_grads([model], grid, clip)
        opt.step()
        out.append({n: _full(p) for n, p in model.named_parameters()})
    return out


def _tp_slice(name: str, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    dim = 0 if ".fc1." in name else 1 if name.endswith("fc2.weight") else None
    if tp == 1 or dim is None:
        return full
    n = full.shape[dim] // tp
    return full.narrow(dim, tp_rank * n, n)


def _max_error(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]], tp: int = 1,
               tp_rank: int = 0) -> float:
    err = 0.0
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for name in w:
            err = max(err, float((g[name] - _tp_slice(name, w[name], tp, tp_rank)).abs().max()))
    return err


def memory_ratio() -> float:
    """FSDP bytes per rank (params + grads + AdamW state) after a step, over one process's bytes."""
    grid = build_grid(ParallelDims())
    tokens, target = batches(1)[0]
    sizes = []
    for sharded in (False, True):
        model = Net(tied=False)
        if sharded:
            model = apply_fsdp(model, grid)
        opt = adamw(model)
        model(tokens, target).backward()
        opt.step()
        sizes.append(memory_bytes([model], opt)["total"])
    return sizes[1] / sizes[0]


def cases_dp2() -> dict[str, float]:
    want = reference()
    return {
        "dp2": _max_error(train_fsdp(2), want),
        "dp2 offload": _max_error(train_fsdp(2, offload=True), want),
        "dp2 schedule": _max_error(train_fsdp(2, schedule=True), want),
        "dp2 untied, no clip": _max_error(train_fsdp(2, tied=False, clip=0.0), reference(tied=False, clip=0.0)),
    }


def cases_dp4() -> dict[str, float]:
    grid = build_grid(ParallelDims(tp=2))
    want = reference()
    return {
        "dp4": _max_error(train_fsdp(4), want),
        "hsdp 2x2": _max_error(train_fsdp(4, shard_size=2), want),
        "tp2 x dp2": _max_error(train_fsdp(2, tp=2), want, tp=2, tp_rank=grid.tp_rank),
        "memory dp4/dp1": memory_ratio(),
    }


def test_fsdp_dp2_parity():
    for rank, errors in enumerate(run_distributed(cases_dp2, 2)):
        for case, err in errors.items():
            assert err < TOL, f"rank {rank} {case}: max |param - reference| = {err:.2e}"


def test_fsdp_dp4_hsdp_tp_parity_and_memory():
    for rank, results in enumerate(run_distributed(cases_dp4, 4, timeout=300)):
        ratio = results.pop("memory dp4/dp1")
        assert abs(ratio - 0.25) < 0.25 * 0.05, f"rank {rank}: dp4 holds {ratio:.3f} of dp1's bytes"
        for case, err in results.items():
            assert err < TOL, f"rank {rank} {case}: max |param - reference| = {err:.2e}"


def test_check_fsdp_errors():
    check_fsdp(4, shard_size=2)
    check_fsdp(4, fsdp=False, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match=r"parallel\.fsdp and parallel\.use_distributed_optimizer"):
        check_fsdp(4, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match=r"parallel\.fsdp_shard_size=3 .*parallel\.dp = 4.*\[1, 2, 4\]"):
        check_fsdp(4, shard_size=3)
    with pytest.raises(ValueError, match=r"dp\*cp = 2\*2"):
        check_fsdp(2, shard_size=3, cp=2)
    with pytest.raises(ValueError, match="positive divisor"):
        check_fsdp(4, shard_size=0)


def test_apply_fsdp_errors():
    from mg_parallel.grid import ProcessGrid

    with pytest.raises(ValueError, match="torch.distributed initialised"):
        apply_fsdp(Net(), ProcessGrid.single(torch.device("cpu")))
    with pytest.raises(ValueError, match=r"'emb.weight' is torch.bfloat16.*do not cast the model"):
        apply_fsdp(Net().to(torch.bfloat16), ProcessGrid.single(torch.device("cpu")), "bf16")
