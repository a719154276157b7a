"""Training parity: DDP + optimizer (optionally ZeRO, tp, sp, grad accumulation, clipping) match a
single-process plain-torch model trained with torch.optim.AdamW on the full batch, step by step."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from mg_parallel.distributed import DistributedDataParallel, finalize_model_grads
from mg_parallel.grid import ParallelDims, ProcessGrid, build_grid
from mg_parallel.optimizer import OptimizerConfig, build_optimizer
from mg_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, mark_replicated
from mg_parallel.testing import run_distributed

H, HEADS, FFN, V, S, B, LAYERS = 16, 4, 64, 24, 8, 8, 2
LR, WD = 1e-2, 0.1


def full_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """The full (unsharded) initial weights of the test model, by parameter name."""
    g = torch.Generator().manual_seed(seed)
    w = {}
    for i in range(LAYERS):
        for name, shape in (("q", (H, H)), ("k", (H, H)), ("v", (H, H)), ("proj", (H, H)), ("fc1", (FFN, H)), ("fc2", (H, FFN))):
            w[f"layers.{i}.{name}.weight"] = torch.randn(shape, generator=g) * 0.2
            if name != "k":  # a key bias has an analytically zero gradient (softmax shift invariance)
                w[f"layers.{i}.{name}.bias"] = torch.randn(shape[0], generator=g) * 0.02
        for ln in ("ln1", "ln2"):
            w[f"layers.{i}.{ln}.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
            w[f"layers.{i}.{ln}.bias"] = 0.1 * torch.randn(H, generator=g)
    w["ln_f.weight"] = torch.ones(H)
    w["ln_f.bias"] = torch.zeros(H)
    w["head.weight"] = torch.randn(V, H, generator=g) * 0.2
    w["head.bias"] = torch.zeros(V)
    return w


def batch(seed: int = 1, steps: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` full batches: inputs ``[S, B, H]`` and targets ``[S, B]``."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(S, B, H, generator=g), torch.randint(0, V, (S, B), generator=g)) for _ in range(steps)]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    s, b, hl = q.shape
    d = hl // heads

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(s, b, heads, d).permute(1, 2, 0, 3)  # [b, heads, s, d]

    out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, hl)


class Layer(nn.Module):
    """Pre-norm attention + MLP block from tensor-parallel layers (tp_group None = plain)."""

    def __init__(self, i: int, w: dict[str, torch.Tensor], tp_group, tp: int, sp: bool) -> None:
        super().__init__()
        self.heads = HEADS // tp
        self.sp, self.tp_group = sp, tp_group

        def init(name: str):
            return lambda t: t.copy_(w[f"layers.{i}.{name}.weight"])

        for name in ("q", "k", "v"):
            setattr(self, name, ColumnParallelLinear(
                H, H, tp_group=tp_group, sequence_parallel=sp, init_method=init(name), bias=name != "k"
            ))
        self.proj = RowParallelLinear(H, H, tp_group=tp_group, sequence_parallel=sp, init_method=init("proj"))
        self.fc1 = ColumnParallelLinear(H, FFN, tp_group=tp_group, sequence_parallel=sp, init_method=init("fc1"))
        self.fc2 = RowParallelLinear(FFN, H, tp_group=tp_group, sequence_parallel=sp, init_method=init("fc2"))
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        mark_replicated(self.ln1, self.ln2)  # plain torch modules: the same on every tp rank
        with torch.no_grad():
            for name, mod in (("q", self.q), ("v", self.v), ("fc1", self.fc1)):
                full = w[f"layers.{i}.{name}.bias"]
                n = full.numel() // tp
                r = 0 if tp_group is None else torch.distributed.get_rank(tp_group)
                mod.bias.copy_(full[r * n : (r + 1) * n])
            for name in ("proj", "fc2", "ln1", "ln2"):
                getattr(self, name).bias.copy_(w[f"layers.{i}.{name}.bias"])
            self.ln1.weight.copy_(w[f"layers.{i}.ln1.weight"])
            self.ln2.weight.copy_(w[f"layers.{i}.ln2.weight"])
        if sp:
            for p in (*self.ln1.parameters(), *self.ln2.parameters()):
                p.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.proj(_attention(self.q(h), self.k(h), self.v(h), self.heads))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyModel(nn.Module):
    """Two layers, a final norm and a vocabulary head (gathered output); loss = mean CE."""

    def __init__(self, w: dict[str, torch.Tensor], tp_group=None, tp: int = 1, sp: bool = False) -> None:
        super().__init__()
        self.sp, self.tp_group = sp, tp_group
        self.layers = nn.ModuleList(Layer(i, w, tp_group, tp, sp) for i in range(LAYERS))
        self.ln_f = nn.LayerNorm(H)
        mark_replicated(self.ln_f)
        self.head = ColumnParallelLinear(
            H, V, tp_group=tp_group, sequence_parallel=sp, gather_output=True, init_method=lambda t: t.copy_(w["head.weight"])
        )
        with torch.no_grad():
            self.ln_f.weight.copy_(w["ln_f.weight"])
            self.ln_f.bias.copy_(w["ln_f.bias"])
            self.head.bias.zero_()
        if sp:
            for p in self.ln_f.parameters():
                p.sequence_parallel = True

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.sp:
            tp, r = torch.distributed.get_world_size(self.tp_group), torch.distributed.get_rank(self.tp_group)
            x = x.chunk(tp, dim=0)[r].contiguous()
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, V).float(), target.reshape(-1))


class RefLayer(nn.Module):
    """The same block from plain nn.Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.proj = (nn.Linear(H, H, bias=i != 1) for i in range(4))
        self.fc1, self.fc2 = nn.Linear(H, FFN), nn.Linear(FFN, H)
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.proj(_attention(self.q(h), self.k(h), self.v(h), HEADS))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class RefModel(nn.Module):
    def __init__(self, w: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(RefLayer() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(H), nn.Linear(H, V)
        self.load_state_dict(w)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(self.ln_f(x)).reshape(-1, V), target.reshape(-1))


def reference_run(steps: int = 10, clip: float = 0.0) -> tuple[list[dict[str, torch.Tensor]], list[float], list[float]]:
    """Plain torch + AdamW on the full batch: parameters after each step, losses, grad norms."""
    torch.manual_seed(0)
    model = RefModel(full_weights())
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    params, losses, norms = [], [], []
    for x, t in batch(steps=steps):
        opt.zero_grad()
        loss = model(x, t)
        loss.backward()
        if clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(loss.item())
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return params, losses, norms


def local_slice(full: torch.Tensor, param: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """This tp rank's part of a full reference tensor, shaped like ``param``."""
    if not getattr(param, "tensor_parallel", False):
        return full
    dim = param.partition_dim
    n = param.shape[dim]
    return full.narrow(dim, grid.tp_rank * n, n)


def train(grid: ProcessGrid, *, distributed: bool, micro: int = 1, clip: float = 0.0, sp: bool = False,
          steps: int = 10, bucket_mb: float = 0.004, zero_stage: int = 1, precision: str = "fp32",
          extra: dict | None = None, hook=None):
    """Train the parallel model on this rank's share of every batch; returns (models' params per
    step as name -> local tensor, losses (global mean), grad norms, optimizer)."""
    torch.manual_seed(0)
    model = TinyModel(full_weights(), grid.tp_group, grid.tp_size, sp)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    model.to(dtype)
    ddp = DistributedDataParallel(
        model, grid, bucket_size_mb=bucket_mb, use_distributed_optimizer=distributed, zero_stage=zero_stage,
        grad_reduce_in_fp32=precision != "fp32",
    )
    cfg = OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=clip, use_distributed_optimizer=distributed,
                          precision=precision, **(extra or {}))
    opt = build_optimizer([ddp], grid, cfg)
    per_rank = B // grid.dp_size

    def snapshot() -> dict[str, torch.Tensor]:
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}

    out, losses, norms, applied = [], [], [], []
    for step, (x, t) in enumerate(batch(steps=steps)):
        opt.zero_grad()
        xs = x[:, grid.dp_rank * per_rank : (grid.dp_rank + 1) * per_rank].to(dtype)
        ts = t[:, grid.dp_rank * per_rank : (grid.dp_rank + 1) * per_rank]
        total = 0.0
        for m, (xm, tm) in enumerate(zip(xs.chunk(micro, dim=1), ts.chunk(micro, dim=1))):
            last = m == micro - 1
            ctx = ddp.no_sync() if not last else _null()
            with ctx:
                loss = ddp(xm, tm) / micro
                if m == 0 and step > 0:
                    # Read the previous step's parameters after a forward: with overlapped param
                    # all-gather, the forward pre-hooks are what makes them complete.
                    out.append(snapshot())
                opt.scale_loss(loss).backward()
            total += loss.item()
        finalize_model_grads([ddp], grid)
        if hook is not None:
            hook(step, ddp, grid)
        ok, norm = opt.step()
        applied.append(ok)
        norms.append(norm)
        lt = torch.tensor([total / grid.dp_size])
        if grid.dp_group is not None:
            torch.distributed.all_reduce(lt, group=grid.dp_group)
        losses.append(lt.item())
    ddp.finish_param_sync()
    out.append(snapshot())
    return out, losses, norms, opt, applied


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _param_errors(grid: ProcessGrid, out, ref_params, model_names_to_param) -> list[float]:
    errs = []
    for step_params, ref in zip(out, ref_params):
        worst = 0.0
        for name, local in step_params.items():
            expect = local_slice(ref[name], model_names_to_param[name], grid)
            worst = max(worst, (local - expect).abs().max().item())
        errs.append(worst)
    return errs


def _parity_worker(variants: list[dict]) -> dict[str, dict]:
    """Run each variant (tp, distributed, micro, clip, sp, zero_stage) and the reference here."""
    results = {}
    refs = {}
    for var in variants:
        # "single": the one-process layout (tp=1, dp=1) run inside the multi-rank job.
        grid = ProcessGrid.single() if var.get("single") else build_grid(ParallelDims(tp=var.get("tp", 1)))
        clip = var.get("clip", 0.0)
        if clip not in refs:
            refs[clip] = reference_run(clip=clip)
        ref_params, ref_losses, ref_norms = refs[clip]
        out, losses, norms, opt, _ = train(
            grid, distributed=var["distributed"], micro=var.get("micro", 1), clip=clip, sp=var.get("sp", False),
            zero_stage=var.get("zero_stage", 1), extra={"overlap_param_gather": var.get("overlap_gather", False)},
        )
        shapes = {n: p for c in opt.chunks for n, p in c.module.named_parameters()}
        key = ",".join(f"{k}={v}" for k, v in sorted(var.items()))
        results[key] = {
            "param_err": _param_errors(grid, out, ref_params, shapes),
            "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "norms": norms, "ref_norms": ref_norms,
            "n_buckets": len(opt.chunks[0].buckets),
            "straddles": any(p.numel != p.param.numel() for p in opt.pieces),
        }
    return results


def _check(results: list[dict], tol: float = 2e-5) -> None:
    for rank, res in enumerate(results):
        for key, r in res.items():
            assert max(r["param_err"]) < tol, f"rank {rank} {key}: param error per step {r['param_err']}"
            assert r["loss_err"] < tol, f"rank {rank} {key}: loss error {r['loss_err']}"
            assert r["n_buckets"] > 1, f"{key}: the test model should span several buckets"
            if "clip=" in key:
                assert r["ref_norms"][0] > 0.05, "clipping must be active in the clip variant"
                for a, b in zip(r["norms"], r["ref_norms"]):
                    assert math.isclose(a, b, rel_tol=1e-4), f"rank {rank} {key}: grad norm {a} vs reference {b}"


def test_parity_two_ranks_dp1_dp2_tp2():
    results = run_distributed(_parity_worker, 2, [
        {"single": True, "distributed": False, "micro": 4},
        {"single": True, "distributed": True, "clip": 0.05},
        {"distributed": False},
        {"distributed": True},
        {"distributed": True, "micro": 4},
        {"distributed": True, "clip": 0.05},
        {"distributed": False, "clip": 0.05, "micro": 4},
        {"distributed": True, "zero_stage": 2, "micro": 4, "overlap_gather": True},
        {"tp": 2, "distributed": False},
        {"tp": 2, "distributed": True, "clip": 0.05},
    ], timeout=240)
    _check(results)
    # With the distributed optimizer at dp=2 some parameter must straddle a shard boundary.
    assert results[0]["distributed=True"]["straddles"]


def test_parity_four_ranks_tp2_dp2():
    results = run_distributed(_parity_worker, 4, [
        {"tp": 2, "distributed": False},
        {"tp": 2, "distributed": True, "micro": 4, "clip": 0.05},
        {"tp": 2, "distributed": True, "sp": True, "clip": 0.05},
    ], timeout=240)
    _check(results)
