"""FSDP2 through apply_fsdp: training parity against one process (dp2, dp4, HSDP 2x2, tp2 x dp2, gradient
accumulation, clipping, a tied embedding, CPU offload, a schedule driving the micro-batches; 10 steps), memory per rank,
and the configuration errors."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mg_parallel.distributed import (
    FullyShardedChunk,
    apply_fsdp,
    check_fsdp,
    clip_fsdp_grads,
    finalize_fsdp_grads,
    memory_bytes,
    no_gradient_sync,
)
from mg_parallel.grid import ParallelDims, build_grid
from mg_parallel.optimizer import OptimizerConfig, build_optimizer
from mg_parallel.pipeline import forward_backward_1f1b, forward_backward_no_pipelining
from mg_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_from_sequence_parallel_region,
    mark_replicated,
    mark_sequence_parallel,
    scatter_to_sequence_parallel_region,
)
from mg_parallel.testing import run_distributed

V, H, FFN, LAYERS, S, B = 32, 16, 64, 2, 4, 8
LR, WD, CLIP, STEPS, TOL = 1e-2, 0.1, 0.5, 10, 2e-5


class Block(nn.Module):
    """Pre-norm MLP block on [s, b, h]; fc1/fc2 are column/row-parallel (plain F.linear at tp_group=None);
    ``sp``: sequence parallel ([s/tp, b, h] between blocks)."""

    def __init__(self, w: dict[str, torch.Tensor], i: int, tp_group, sp: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        (mark_sequence_parallel if sp else mark_replicated)(self.norm)
        kw = dict(tp_group=tp_group, sequence_parallel=sp)
        self.fc1 = ColumnParallelLinear(H, FFN, init_method=lambda t: t.copy_(w[f"fc1.{i}"]), **kw)
        self.fc2 = RowParallelLinear(FFN, H, init_method=lambda t: t.copy_(w[f"fc2.{i}"]), **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Embedding, LAYERS blocks, final norm, output head tied to the embedding; forward returns mean CE."""

    def __init__(self, tp_group=None, tied: bool = True, sp: bool = False) -> None:
        super().__init__()
        self.tp_group, self.sp = tp_group, sp
        g = torch.Generator().manual_seed(0)
        w = {f"{n}.{i}": torch.randn(shape, generator=g) * 0.3
             for i in range(LAYERS) for n, shape in (("fc1", (FFN, H)), ("fc2", (H, FFN)))}
        self.emb = nn.Embedding(V, H)
        self.layers = nn.ModuleList(Block(w, i, tp_group, sp) for i in range(LAYERS))
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(V, H, generator=g))
            self.head.weight.copy_(torch.randn(V, H, generator=g) * 0.3)
        if tied:
            self.head.weight = self.emb.weight
        mark_replicated(self.emb, self.norm, self.head)

    def forward(self, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens.t())  # [s, b, h]
        if self.sp:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)  # [s/tp, b, h]
        for layer in self.layers:
            x = layer(x)
        if self.sp:
            x = gather_from_sequence_parallel_region(x, self.tp_group, tensor_parallel_output_grad=False)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), target.t().flatten())


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)) for _ in range(steps)]


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)


def reference(tied: bool = True, clip: float = CLIP) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """One process, the full batch: parameters after each step, and each step's gradient norm."""
    model = Net(tied=tied)
    opt = adamw(model)
    out, norms = [], []
    for tokens, target in batches():
        opt.zero_grad()
        model(tokens, target).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))))
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out, norms


def train_fsdp(want: list[dict[str, torch.Tensor]], *, tp: int = 1, split_layers: bool = True,
               shard_size: int | None = None, micro: int = 2, tied: bool = True, clip: float = CLIP,
               offload: bool = False, schedule: bool = False, reshard_after_forward: bool = True,
               sp: bool = False, cp: int = 1) -> float:
    """Train under apply_fsdp on this rank's share of each batch (``micro`` micro-batches); returns the largest
    difference of this rank's parameter shards from the reference's after any step.

    ``split_layers=False`` builds plain (unsplit) layers at tp > 1: every tp rank then trains its own dp
    replica, and the grad norm must count each of its parameters once. ``cp``: each context-parallel rank
    takes 1/cp of every sequence (the blocks are per token, so no attention is needed to check the
    averaging over dp x cp).
    """
    grid = build_grid(ParallelDims(tp=tp, cp=cp))
    model = Net(grid.tp_group if split_layers else None, tied, sp)
    if not split_layers:
        for p in model.parameters():
            p.tensor_parallel = False
    model = apply_fsdp(model, grid, "fp32", shard_size=shard_size, offload=offload,
                       reshard_after_forward=reshard_after_forward)
    opt = adamw(model)
    per_rank = B // grid.dp_size
    tp_split = (grid.tp_size, grid.tp_rank) if split_layers else (1, 0)
    err = 0.0
    for (tokens, target), ref in zip(batches(), want, strict=True):
        opt.zero_grad()
        mine = slice(grid.dp_rank * per_rank, (grid.dp_rank + 1) * per_rank)
        tokens, target = (t[mine].chunk(cp, dim=1)[grid.cp_rank] for t in (tokens, target))
        micros = list(zip(tokens.chunk(micro), target.chunk(micro)))
        if schedule:  # the pipeline package's micro-batch loop drives forward and backward
            forward_backward_no_pipelining(lambda b, m: (m(*b), lambda loss: (loss, {})), iter(micros), [model],
                                           micro, grid, tensor_shape=(1,), finalize_grads=finalize_fsdp_grads)
        else:
            for i, (x, t) in enumerate(micros):
                with no_gradient_sync(model) if i < micro - 1 else contextlib.nullcontext():
                    (model(x, t) / micro).backward()
        if sp and not schedule:
            finalize_fsdp_grads([model], grid)  # the norms' partial gradients, summed over tp
        if clip:
            clip_fsdp_grads([model], grid, clip)
        opt.step()
        err = max(err, shard_error(model.named_parameters(), ref, tp_split, set(ref)))
    return err


def train_chunk(want: tuple[list[dict[str, torch.Tensor]], list[float]], *, tp: int = 1,
                shard_size: int | None = None, offload: bool = False, micro: int = 2) -> float:
    """FullyShardedChunk + build_optimizer (the FSDP optimizer: AdamW, clipping) driven by the no-pipelining
    schedule, as mg train runs it; returns the largest parameter-shard error after any step, and asserts
    that every step's gradient norm is the reference's."""
    grid = build_grid(ParallelDims(tp=tp))
    chunk = FullyShardedChunk(Net(grid.tp_group), grid, shard_size=shard_size, offload=offload)
    config = OptimizerConfig(lr=LR, weight_decay=WD, decay_1d_params=True, clip_grad=CLIP)
    opt = build_optimizer([chunk], grid, config)
    per_rank = B // grid.dp_size
    err = 0.0
    for (tokens, target), ref, ref_norm in zip(batches(), *want, strict=True):
        opt.zero_grad()
        mine = slice(grid.dp_rank * per_rank, (grid.dp_rank + 1) * per_rank)
        micros = zip(tokens[mine].chunk(micro), target[mine].chunk(micro))
        forward_backward_no_pipelining(lambda b, m: (m(*b), lambda loss: (loss, {})), micros, [chunk], micro, grid,
                                       tensor_shape=(1,), finalize_grads=finalize_fsdp_grads)
        applied, norm = opt.step()
        assert applied and norm == pytest.approx(ref_norm, rel=1e-5), (norm, ref_norm)
        err = max(err, shard_error(chunk.module.named_parameters(), ref, (grid.tp_size, grid.tp_rank), set(ref)))
    return err


def shard_error(named_params, ref: dict[str, torch.Tensor], tp_split: tuple[int, int], names: set[str],
                rename=lambda n: n) -> float:
    """Largest |local shard - the same slice of the reference| over ``named_params`` (DTensors), whose
    (renamed) names must be exactly ``names``; ``tp_split`` = (tp, tp_rank) of mg's column/row layers."""
    err, seen = 0.0, set()
    for name, p in named_params:
        name = rename(name)
        seen.add(name)
        full = ref[name]
        dim = 0 if ".fc1." in name else 1 if name.endswith("fc2.weight") else None
        if dim is not None and tp_split[0] > 1:
            full = full.chunk(tp_split[0], dim)[tp_split[1]]
        for mesh_dim, placement in enumerate(p.placements):
            if placement.is_shard():
                full = full.chunk(p.device_mesh.size(mesh_dim), placement.dim)[p.device_mesh.get_local_rank(mesh_dim)]
        local = p.to_local().detach()
        assert local.shape == full.shape, (name, local.shape, full.shape)
        err = max(err, float((local - full).abs().max()))
    assert seen == names, sorted(seen ^ names)
    return err


class Stage(nn.Module):
    """Pipeline stage ``pp_rank`` of 2 cut from a Net: the first holds the embedding and layer 0, the last the
    other layers, the norm and the head, whose weight is a copy of the embedding (``shared_embedding``)."""

    def __init__(self, pp_rank: int) -> None:
        super().__init__()
        net = Net(tied=False)
        self.first = pp_rank == 0
        if self.first:
            self.emb, self.layers = net.emb, net.layers[:1]
            self.emb.weight.shared_embedding = True
        else:
            self.layers, self.norm, self.head = net.layers[1:], net.norm, net.head
            with torch.no_grad():
                self.head.weight.copy_(net.emb.weight)
            self.head.weight.shared_embedding = True
        self.input_tensor = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) if self.first else self.input_tensor
        for layer in self.layers:
            x = layer(x)
        return x if self.first else self.head(self.norm(x))


def train_pipeline(want: list[dict[str, torch.Tensor]], micro: int = 2) -> float:
    """pp2 x dp2: each stage FSDP-sharded over its dp pair (kept gathered between forward and backward), driven
    by the 1F1B schedule; returns the largest difference of this rank's shards from the reference's."""
    grid = build_grid(ParallelDims(pp=2))
    model = apply_fsdp(Stage(grid.pp_rank), grid, reshard_after_forward=False)
    opt = adamw(model)
    per_rank = B // grid.dp_size
    offset = 0 if grid.is_first_stage else 1  # the last stage's layers[i] is the reference's layers[i + 1]

    def rename(n: str) -> str:
        if n.startswith("layers."):
            i, rest = n.split(".", 2)[1:]
            return f"layers.{int(i) + offset}.{rest}"
        return n.replace("head.weight", "emb.weight")  # tied: the last stage's head is the embedding

    def forward_step(batch, model):
        tokens, target = batch
        return model(tokens), lambda logits: (F.cross_entropy(logits.flatten(0, 1), target.flatten()), {})

    names = {rename(n) for n, _ in model.named_parameters()}
    assert names == ({"emb.weight"} | {n for n in want[0] if n.startswith("layers.0.")} if grid.is_first_stage
                     else set(want[0]) - {n for n in want[0] if n.startswith("layers.0.")})
    err = 0.0
    for (tokens, target), ref in zip(batches(), want, strict=True):
        opt.zero_grad()
        mine = slice(grid.dp_rank * per_rank, (grid.dp_rank + 1) * per_rank)
        micros = zip(tokens[mine].chunk(micro), target[mine].chunk(micro))
        forward_backward_1f1b(forward_step, micros, model, micro, grid, tensor_shape=(per_rank // micro, S, H),
                              finalize_grads=finalize_fsdp_grads)
        clip_fsdp_grads([model], grid, CLIP)
        opt.step()
        err = max(err, shard_error(model.named_parameters(), ref, (1, 0), names, rename))
    return err


def memory_ratio() -> tuple[float, float]:
    """FSDP bytes per rank (params + grads + AdamW state) after a step, over one process's bytes; and the
    largest excess of parameter bytes during a step (read at every block's forward and backward, before
    and after) over those between steps, in units of one block's unsharded parameters."""
    grid = build_grid(ParallelDims())
    tokens, target = batches(1)[0]
    sizes, peak = [], 0
    for sharded in (False, True):
        model = Net(tied=False)
        if sharded:
            model = apply_fsdp(model, grid)
        opt = adamw(model)
        if sharded:
            def probe(*_, model=model):
                nonlocal peak
                peak = max(peak, memory_bytes([model])["params"])

            for block in model.layers:
                block.register_forward_pre_hook(probe)
                block.register_forward_hook(probe)
                block.register_full_backward_pre_hook(probe)
                block.register_full_backward_hook(probe)
        model(tokens, target).backward()
        opt.step()
        sizes.append(memory_bytes([model], opt)["total"])
    block_bytes = sum(p.numel() * 4 for p in Net(tied=False).layers[0].parameters())
    between = memory_bytes([model])["params"]
    return sizes[1] / sizes[0], (peak - between) / block_bytes


def bf16_loss_error() -> float:
    """apply_fsdp(..., "bf16"): computes in bf16 while parameters and gradients stay fp32 shards; returns
    |loss - fp32 loss| / fp32 loss on this rank's rows of one batch (the loss itself is bf16: ulp ~0.4%)."""
    grid = build_grid(ParallelDims())
    tokens, target = (t.chunk(grid.dp_size)[grid.dp_rank] for t in batches(1)[0])
    want = Net()(tokens, target)
    model = apply_fsdp(Net(), grid, "bf16")
    loss = model(tokens, target)
    loss.backward()
    assert loss.dtype == torch.bfloat16
    assert {(p.to_local().dtype, p.grad.to_local().dtype) for p in model.parameters()} == {(torch.float32,) * 2}
    return abs(float(loss.detach().float() / want.detach() - 1))


def cases(tied: tuple[list[dict[str, torch.Tensor]], list[float]], untied: tuple[list[dict[str, torch.Tensor]], list[float]]
          ) -> dict[str, float]:
    """Every multi-process case on a world of 4 (one pool): parameter errors, and the memory ratio."""
    tied_ref, untied_ref = tied[0], untied[0]
    return {
        "FullyShardedChunk + FSDP optimizer, dp4": train_chunk(tied),
        "FullyShardedChunk + FSDP optimizer, tp2 x hsdp(1x2), offload": train_chunk(tied, tp=2, shard_size=1,
                                                                                   offload=True),
        "dp2": train_fsdp(tied_ref, tp=2, split_layers=False),
        "dp2 untied, offload, no_pipelining schedule": train_fsdp(
            untied_ref, tp=2, split_layers=False, tied=False, offload=True, schedule=True),
        "dp4": train_fsdp(tied_ref),
        "hsdp 2x2, no reshard after forward": train_fsdp(tied_ref, shard_size=2, reshard_after_forward=False),
        "tp2 x dp2": train_fsdp(tied_ref, tp=2),
        "tp2 sequence parallel x dp2": train_fsdp(tied_ref, tp=2, sp=True),
        "dp2 x cp2, hsdp 2x2 over dp x cp": train_fsdp(tied_ref, cp=2, shard_size=2),
        "pp2 x dp2 1f1b": train_pipeline(tied_ref),
        "memory dp4/dp1": memory_ratio(),
        "bf16 loss": bf16_loss_error(),
    }


def test_fsdp_parity_and_memory():
    for rank, results in enumerate(run_distributed(cases, 4, reference(), reference(tied=False), timeout=300)):
        (ratio, window), bf16 = results.pop("memory dp4/dp1"), results.pop("bf16 loss")
        assert 0 < bf16 < 0.02, f"rank {rank}: bf16 loss differs from fp32 by {bf16:.1%}"
        assert abs(ratio - 0.25) < 0.25 * 0.05, f"rank {rank}: dp4 holds {ratio:.3f} of dp1's bytes"
        # The root unit (embedding, norm, head) stays gathered through the forward; on top of it, at most the
        # block running and the one prefetched are gathered.
        root = sum(p.numel() * 4 for n, p in Net(tied=False).named_parameters() if not n.startswith("layers."))
        block = sum(p.numel() * 4 for p in Net(tied=False).layers[0].parameters())
        assert 1 <= window <= root / block + 2, f"rank {rank}: {window:.2f} blocks' parameters gathered at the peak"
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
    net = Net()
    with pytest.raises(ValueError, match=r"'head.weight' is the same tensor as 'emb.weight'.*different FSDP units"):
        apply_fsdp(net, ProcessGrid.single(torch.device("cpu")), blocks=[net.head])
