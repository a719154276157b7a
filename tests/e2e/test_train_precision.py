"""`mg train` in bf16 and fp16 against a GPT written here in plain PyTorch.

The reference is the test model (``tiny-gpt2`` with conftest's TINY overrides: 4 pre-norm layers, width 64,
4 heads, MLP 256, learned positions, LayerNorm, tanh-GELU, biases, tied embeddings, vocabulary 512)
trained the way mg's mixed precision is specified, and ``mg train`` (a subprocess) must reproduce it.

Where the numbers come from:

* Initial weights: a first ``mg train`` run in fp32 with a learning rate of 1e-46 (``optim.lr=0`` is
  rejected; a step this small rounds away in fp32), checkpointed after iterations 1 and 2.
  The fixture checks that iterations 1 and 2 hold bit-identical weights, that biases are still 0 and
  LayerNorm weights 1, and that the Adam moments are non-zero, so the gradients were real and the steps
  changed nothing. mg initialises in fp32 and casts, so the bf16/fp16 weights are these rounded; the fp16
  test checks this bit for bit after its skipped steps, the bf16 test through iteration 1.
* Data: the token ids of global batch k come from mg_data, as ``mg train`` gets them (GPTDataset with the
  run's seed, split and sample count, GlobalBatchSampler order). The data is not what is under test.
* Training: AdamW (``torch.optim.AdamW``) on an fp32 main copy with mg train's hyper-parameters, the
  schedule as a formula (:func:`lr_at`), clipping by global norm and, for fp16, the dynamic loss scaler
  as formulas (:class:`ScalerRule`). The test checks that the resolved config still has these values.

What the reference mirrors of mg (design choices, not bugs):

* parameters in bf16/fp16 and the compute in that dtype: embedding sum, residual stream, LayerNorm,
  attention (``scaled_dot_product_attention``, whose kernel accumulates in fp32), tanh-GELU and the tied
  output head; only the logits are upcast to fp32 for the cross entropy, and the masked mean is fp32;
* activations laid out [seq, batch, hidden] and the fused QKV weight in Megatron's grouped order
  (per head: its q rows, then its k rows, then its v rows), as mg_models' SelfAttention reads it;
* the fp32 main copy starts from the low-precision parameters (not from the fp32 draw) and is copied
  back to them after every step;
* gradients: each micro-batch's backward gives low-precision grads of ``loss / micro_batches``
  (times the loss scale for fp16; the two uses of the tied embedding summed by autograd in that dtype),
  added into fp32 buffers (mg's DDP keeps them in fp32);
* weight decay on parameters with ndim >= 2 only; torch's fused AdamW kernel, which mg's adamw_update
  calls on CPU (``fused=True`` here);
* the global norm sums the squared per-tensor norms in reverse registration order, the order of mg's
  gradient buffers: any other order changes the norm in its last bit, and bf16 rounding of the
  weights turns that into ~4e-5 of loss by iteration 20 (measured);
* fp16: unscale by multiplying with 1/scale in fp32; one non-finite gradient anywhere skips the step
  (no Adam step, no moment update; the learning rate still follows the iteration).

Measured (relative differences, max over the 20 iterations) and asserted:

* bf16, 1 process: losses and grad norms equal to the reference bit for bit (dp2 too); tp2: 1.1e-4 (loss),
  7e-4 (grad norm), from tp's bf16 all-reduce of partial sums.
* fp16 with initial scale 3*2^19: iterations 1-3 overflow (the first does not back off, hysteresis 2;
  the next two halve the scale), iteration 4 onwards steps; every decision is at least 0.34 octaves from
  its overflow threshold (measured with the reference). 1 process: bit for bit; pp2: 5.5e-6 (loss).
* Asserted: 1e-3 (loss) and 5e-3 (grad norm) at bf16 tp2; 1e-4 and 5e-4 at one process and at fp16
  pp2. Changes that should pass (the norm summed in another order, AdamW's non-fused path) move the
  1-process trajectory by at most 2.4e-5 (loss) / 9.5e-5 (grad norm); errors it must catch give more:
  weight decay on 1-D parameters too 3.7e-4 / 2.8e-3, the same model computed in fp32 2.4e-4 / 1.7e-3,
  no clipping 1.5e-3 / 1.3e-2, beta2 0.999 1.5e-3 / 3.8e-3. At one process iteration 1 (no trajectory
  noise yet: initial weights, batch 1) must agree within 1e-6 (loss) and 1e-5 (grad norm), where an fp32
  computation differs by 6e-4 in the grad norm. Skip flags and loss scales must be equal at every
  iteration; a pipeline rank that steps (even on zeroed gradients) while the other skips fails the
  checkpoint taken after the skips.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from tests.e2e.conftest import mg, read_metrics, tiny_args, train_losses

# The run (conftest's TINY and mg train's defaults), checked against the resolved config of every run.
ITERS, SEQ, MICRO, GLOBAL, SEED = 20, 32, 2, 8, 7
LR, MIN_LR, WARMUP, CLIP = 3e-3, 0.0, 2, 1.0
WEIGHT_DECAY, BETAS, ADAM_EPS = 0.1, (0.9, 0.95), 1e-8
# The model (tiny-gpt2 with TINY's num_layers=4; the vocabulary is the tokenizer's, already a multiple of 128).
LAYERS, HIDDEN, HEADS, FFN, VOCAB, MAX_POS, NORM_EPS = 4, 64, 4, 256, 512, 128, 1e-5
# mg_parallel's DynamicLossScaler defaults (mg train exposes only the initial scale).
HYSTERESIS, GROWTH_INTERVAL, MIN_SCALE = 2, 1000, 1.0
FP16_INITIAL_SCALE = 3 * 2**19

# Relative (loss, grad norm) tolerances at every iteration (see the module docstring for the measurements).
LOOSE_RTOL = (1e-3, 5e-3)
TIGHT_RTOL = (1e-4, 5e-4)


def lr_at(k: int) -> float:
    """Linear warm-up to LR over WARMUP iterations, then cosine to MIN_LR at iteration ITERS (1-based k)."""
    if k <= WARMUP:
        return LR * k / WARMUP
    if k >= ITERS:
        return MIN_LR
    return MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * (k - WARMUP) / (ITERS - WARMUP)))


class ScalerRule:
    """Dynamic loss scale: back off by 2 once HYSTERESIS overflows have been seen (then at every overflow
    until the scale grows again), grow by 2 after GROWTH_INTERVAL clean steps in a row (refilling the
    hysteresis budget), never below MIN_SCALE."""

    def __init__(self, scale: float) -> None:
        self.scale, self.budget, self.clean = scale, HYSTERESIS, 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.clean, self.budget = 0, self.budget - 1
            if self.budget <= 0:
                self.scale = max(self.scale / 2, MIN_SCALE)
        else:
            self.clean += 1
            if self.clean == GROWTH_INTERVAL:
                self.clean, self.budget, self.scale = 0, HYSTERESIS, self.scale * 2


# ----------------------------------------------------------------------------------------- the reference


class Attention(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_qkv = nn.Linear(HIDDEN, 3 * HIDDEN, dtype=dtype)
        self.linear_proj = nn.Linear(HIDDEN, HIDDEN, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        qkv = self.linear_qkv(x).view(s, b, HEADS, 3, HIDDEN // HEADS)  # per head: q, k, v
        q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))  # (b, nh, s, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.linear_proj(y.permute(2, 0, 1, 3).reshape(s, b, HIDDEN))


class MLP(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(HIDDEN, FFN, dtype=dtype)
        self.linear_fc2 = nn.Linear(FFN, HIDDEN, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN, eps=NORM_EPS, dtype=dtype)
        self.self_attention = Attention(dtype)
        self.pre_mlp_layernorm = nn.LayerNorm(HIDDEN, eps=NORM_EPS, dtype=dtype)
        self.mlp = MLP(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dtype) for _ in range(LAYERS))
        self.final_layernorm = nn.LayerNorm(HIDDEN, eps=NORM_EPS, dtype=dtype)


class Embedding(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN, dtype=dtype)
        self.position_embeddings = nn.Embedding(MAX_POS, HIDDEN, dtype=dtype)


class ReferenceGPT(nn.Module):
    """GPT-2-style LM; parameter names are mg's checkpoint names, so loading is a dictionary walk."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.embedding = Embedding(dtype)
        self.decoder = Decoder(dtype)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean token loss (fp32) of a micro-batch of [b, s] tokens, labels, positions and loss mask."""
        e = self.embedding
        x = e.word_embeddings(batch["tokens"].t()) + e.position_embeddings(batch["position_ids"].t())  # (s, b, h)
        for layer in self.decoder.layers:
            x = layer(x)
        logits = F.linear(self.decoder.final_layernorm(x), e.word_embeddings.weight)  # (s, b, V), tied head
        per_token = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch["labels"].t().reshape(-1),
                                    reduction="none").view(SEQ, -1).t()  # (b, s)
        mask = batch["loss_mask"].float()
        return (per_token * mask).sum() / mask.sum().clamp(min=1)


def reference_train(init: dict[str, torch.Tensor], dtype: torch.dtype, batches: list[list[dict[str, torch.Tensor]]],
                    initial_scale: float | None = None) -> dict:
    """Train ReferenceGPT in ``dtype`` from ``init`` (fp32 weights) on ``batches`` (global batch -> micro-batches).

    Returns ``records`` (per iteration: loss, grad_norm or inf when skipped, skipped, loss_scale), the final
    ``params`` (model dtype) and ``main`` (fp32), keyed by mg's parameter names.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the runs (train.threads=1): kernels may sum in another order with more
    try:
        model = ReferenceGPT(dtype)
        model.load_state_dict({n: t.to(dtype) for n, t in init.items()})  # strict: mg's parameter set
        params = dict(model.named_parameters())
        main = {n: p.detach().float() for n, p in params.items()}
        opt = torch.optim.AdamW(
            [{"params": [m for m in main.values() if m.ndim >= 2], "weight_decay": WEIGHT_DECAY},
             {"params": [m for m in main.values() if m.ndim < 2], "weight_decay": 0.0}],
            lr=LR, betas=BETAS, eps=ADAM_EPS, fused=True)
        scaler = ScalerRule(initial_scale) if initial_scale is not None else None
        records = []
        for k, micro_batches in enumerate(batches, start=1):
            grads = {n: torch.zeros_like(m) for n, m in main.items()}
            losses = []
            for batch in micro_batches:
                loss = model(batch)
                losses.append(loss.item())
                loss = loss / len(micro_batches)
                (loss * scaler.scale if scaler else loss).backward()
                for n, p in params.items():
                    grads[n] += p.grad.float()
                    p.grad = None
            rec = {"iteration": k, "loss": sum(losses) / len(losses), "skipped": False}
            if scaler is not None:
                inv = torch.tensor(1.0 / scaler.scale, dtype=torch.float32)
                for g in grads.values():
                    g.mul_(inv)
                rec["skipped"] = not all(bool(torch.isfinite(g).all()) for g in grads.values())
                scaler.update(rec["skipped"])
                rec["loss_scale"] = scaler.scale
            if rec["skipped"]:
                rec["grad_norm"] = math.inf
            else:
                norm = float(torch.stack([g.norm() for g in reversed(grads.values())]).square().sum().sqrt())
                coef = CLIP / (norm + 1e-6)
                for n, g in grads.items():
                    main[n].grad = g * coef if coef < 1 else g
                for group in opt.param_groups:
                    group["lr"] = lr_at(k)
                opt.step()
                with torch.no_grad():
                    for n, p in params.items():
                        p.copy_(main[n])
                rec["grad_norm"] = norm
            records.append(rec)
        return {"records": records, "params": {n: p.detach().clone() for n, p in params.items()}, "main": main}
    finally:
        torch.set_num_threads(threads)


# -------------------------------------------------------------------------------------------- fixtures


def checkpoint_contents(path: Path, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict]:
    """``{name: tensor}`` of every logical tensor under ``prefix`` (prefix stripped) and the saved state."""
    from mg_ckpt import CheckpointReader

    reader = CheckpointReader(str(path), verify=True)
    names = [n for n in reader.specs if n.startswith(prefix)]
    return {n[len(prefix):]: t for n, t in reader.read(names).items()}, reader.extra


@pytest.fixture(scope="module")
def init_weights(corpus, tmp_path_factory) -> dict[str, torch.Tensor]:
    """mg's initial weights (fp32), from a run whose steps change nothing (see the module docstring)."""
    root = tmp_path_factory.mktemp("precision-init")
    mg(*tiny_args(corpus, root / "log", "optim.lr=1e-46", f"checkpoint.save={root / 'ckpt'}", "checkpoint.interval=1",
                  iters=2))
    first, state = checkpoint_contents(root / "ckpt" / "iter_0000001")
    second, _ = checkpoint_contents(root / "ckpt" / "iter_0000002")
    weights = {n[len("model/"):]: t for n, t in first.items() if n.startswith("model/")}
    for name, w in weights.items():
        assert torch.equal(w, second[f"model/{name}"]), f"{name} changed in a step at lr 1e-46"
        assert first[f"optim/{name}/exp_avg"].abs().max() > 0, f"{name} got no gradient in iteration 1"
        if name.endswith(".bias"):
            assert not w.any(), f"{name} is not its initial 0 after a step at lr 1e-46"
        elif "layernorm" in name:
            assert torch.equal(w, torch.ones_like(w)), f"{name} is not its initial 1 after a step at lr 1e-46"
    cfg = state["model_config"]
    shape = (cfg["num_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_query_groups"] or HEADS,
             cfg["ffn_hidden_size"] or 4 * cfg["hidden_size"], cfg["vocab_size"], cfg["max_position_embeddings"],
             cfg["norm_eps"])
    assert shape == (LAYERS, HIDDEN, HEADS, HEADS, FFN, VOCAB, MAX_POS, NORM_EPS), cfg
    kind = (cfg["position_embedding"], cfg["normalization"], cfg["activation"], cfg["add_bias_linear"],
            cfg["add_qkv_bias"] in (None, True), cfg["qk_layernorm"], cfg["tie_word_embeddings"], cfg["sliding_window"])
    assert kind == ("learned", "layernorm", "gelu_tanh", True, True, False, True, None), cfg
    assert weights["embedding.word_embeddings.weight"].shape == (VOCAB, HIDDEN)  # padded vocabulary = the real one
    return weights


@pytest.fixture(scope="module")
def batches(corpus) -> list[list[dict[str, torch.Tensor]]]:
    """Global batches 1..ITERS as mg train draws them: mg_data's GPT samples in GlobalBatchSampler order, cut
    into micro-batches of MICRO (the same micro-batches at dp > 1: rank r takes a contiguous block)."""
    from mg_data import GlobalBatchSampler, GPTDatasetConfig, build_gpt_datasets, build_tokenizer

    tok = build_tokenizer(str(corpus["tokenizer"]))
    config = GPTDatasetConfig(seq_length=SEQ, seed=SEED, eod_id=tok.eod)  # split: mg train's default
    # Sample counts as mg train asks for them: iters x global batch; one evaluation of eval.iters=1 batch.
    train, _, _ = build_gpt_datasets(config, [str(corpus["prefix"])], (ITERS * GLOBAL, GLOBAL, None))
    sampler = GlobalBatchSampler(total_samples=len(train), global_batch_size=GLOBAL, micro_batch_size=MICRO,
                                 dp_rank=0, dp_size=1)
    out = []
    for step in range(ITERS):
        micro = []
        for ids in sampler.micro_batches(step):
            samples = [train[i] for i in ids]
            micro.append({k: torch.stack([torch.from_numpy(s[k]) for s in samples]) for k in samples[0]})
        out.append(micro)
    return out


def train_mg(corpus: dict, root: Path, nproc: int, *sets: str) -> Path:
    """Run ``mg train`` (20 iterations, checkpoint saved under ``root/ckpt``); returns the log directory."""
    log = root / "log"
    flags = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    mg(*tiny_args(corpus, log, f"checkpoint.save={root / 'ckpt'}", *sets), *flags)
    resolved = yaml.safe_load((log / "config.yaml").read_text())
    o, t = resolved["optim"], resolved["train"]
    assert (o["lr"], o["min_lr"], o["warmup_iters"], o["decay_style"], o["decay_iters"] or t["iters"], o["clip_grad"],
            o["weight_decay"], (o["adam_beta1"], o["adam_beta2"]), o["adam_eps"]) == (
        LR, MIN_LR, WARMUP, "cosine", ITERS, CLIP, WEIGHT_DECAY, BETAS, ADAM_EPS), o
    assert (t["micro_batch_size"], t["global_batch_size"], t["seed"], resolved["model"]["seq_length"]) == (
        MICRO, GLOBAL, SEED, SEQ), t
    assert sorted(train_losses(log)) == list(range(1, ITERS + 1))
    return log


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def compare_trajectory(log: Path, reference: dict, rtol: tuple[float, float], what: str) -> list[dict]:
    """Per-iteration loss and grad norm against the reference within ``rtol``; returns mg's training records."""
    records = [r for r in read_metrics(log) if "loss" in r]
    for m, r in zip(records, reference["records"], strict=True):
        it = r["iteration"]
        assert m["iteration"] == it
        assert m["loss"] is not None, f"{what}: iteration {it}: the loss is not finite (logged as null)"
        assert rel(m["loss"], r["loss"]) <= rtol[0], f"{what}: iteration {it}: loss {m['loss']} vs {r['loss']}"
        if not r["skipped"]:
            assert m["grad_norm"] is not None, f"{what}: iteration {it}: grad_norm is not finite (logged as null)"
            assert rel(m["grad_norm"], r["grad_norm"]) <= rtol[1], (
                f"{what}: iteration {it}: grad_norm {m['grad_norm']} vs {r['grad_norm']}")
    return records


def check_final_weights(ckpt: Path, reference: dict, init: dict[str, torch.Tensor], dtype: torch.dtype, rtol: float,
                        what: str) -> None:
    """The final checkpoint: model weights in ``dtype`` equal to their fp32 main copy rounded (copied back after the
    last step), and the whole model within ``rtol`` of the reference, relative to how far training moved it."""
    tensors, _ = checkpoint_contents(ckpt)
    off = moved = 0.0
    for name, ref in reference["params"].items():
        w, main = tensors[f"model/{name}"], tensors[f"optim/{name}/main_param"]
        assert w.dtype == dtype and main.dtype == torch.float32, f"{what}: {name} is {w.dtype} with {main.dtype} main"
        assert torch.isfinite(main).all(), f"{what}: {name} has non-finite values"
        assert torch.equal(w, main.to(dtype)), f"{what}: {name} is not its main copy rounded to {dtype}"
        off += float((w.float() - ref.float()).square().sum())
        moved += float((ref.float() - init[name].to(dtype).float()).square().sum())
    distance = math.sqrt(off / moved)
    assert distance <= rtol, f"{what}: final weights differ from the reference by {distance:.3g} of their update"


# ----------------------------------------------------------------------------------------------- bf16

BF16_LAYOUTS = {"1proc": (1, [], TIGHT_RTOL), "tp2": (2, ["parallel.tp=2"], LOOSE_RTOL),
                # FSDP: fp32 shards gathered in bf16 for compute, gradients reduced in fp32; bf16 model tensors saved
                "dp2-fsdp": (2, ["parallel.fsdp=true"], LOOSE_RTOL)}


@pytest.fixture(scope="module")
def bf16_reference(init_weights, batches) -> dict:
    return reference_train(init_weights, torch.bfloat16, batches)


@pytest.mark.parametrize("layout", list(BF16_LAYOUTS))
def test_bf16_matches_reference(layout, corpus, init_weights, bf16_reference, tmp_path):
    nproc, sets, rtol = BF16_LAYOUTS[layout]
    log = train_mg(corpus, tmp_path, nproc, "train.precision=bf16", *sets)
    records = compare_trajectory(log, bf16_reference, rtol, f"bf16 {layout}")
    assert not any(r["skipped"] for r in records)
    if nproc == 1:
        first, ref = records[0], bf16_reference["records"][0]
        assert rel(first["loss"], ref["loss"]) <= 1e-6 and rel(first["grad_norm"], ref["grad_norm"]) <= 1e-5, (
            f"iteration 1 (initial weights, batch 1): {first} vs {ref}")
    # Measured 0 at 1 process and 0.037 at tp2 (bf16 rounding noise, largest in the key biases, whose exact
    # gradient is zero so Adam moves them by noise alone).
    check_final_weights(tmp_path / "ckpt", bf16_reference, init_weights, torch.bfloat16, 0.15, f"bf16 {layout}")


# ----------------------------------------------------------------------------------------------- fp16

FP16_LAYOUTS = {"1proc": (1, [], TIGHT_RTOL), "pp2": (2, ["parallel.pp=2"], TIGHT_RTOL)}


@pytest.fixture(scope="module")
def fp16_reference(init_weights, batches) -> dict:
    ref = reference_train(init_weights, torch.float16, batches, initial_scale=FP16_INITIAL_SCALE)
    skipped = [r["skipped"] for r in ref["records"]]
    leading = skipped.index(False) if False in skipped else len(skipped)
    # Two or more leading overflows exercise the hysteresis (the first does not back off); enough steps after.
    assert 2 <= leading <= 6 and skipped.count(False) >= 10, (
        f"train.initial_loss_scale={FP16_INITIAL_SCALE} no longer gives a few leading overflows on this corpus "
        f"(skips: {skipped}); choose another")
    ref["leading_skips"] = leading
    return ref


@pytest.mark.parametrize("layout", list(FP16_LAYOUTS))
def test_fp16_loss_scaling_matches_reference(layout, corpus, init_weights, fp16_reference, tmp_path):
    nproc, sets, rtol = FP16_LAYOUTS[layout]
    leading = fp16_reference["leading_skips"]
    log = train_mg(corpus, tmp_path, nproc, "train.precision=fp16", f"train.initial_loss_scale={FP16_INITIAL_SCALE}",
                   f"checkpoint.interval={leading}", *sets)
    ref = fp16_reference["records"]
    records = [r for r in read_metrics(log) if "loss" in r]
    assert [r["skipped"] for r in records] == [r["skipped"] for r in ref]
    assert [r["loss_scale"] for r in records] == [r["loss_scale"] for r in ref]
    assert all((r["grad_norm"] is None) == r["skipped"] for r in records), "a skipped step logs grad_norm null"

    # After the leading skipped steps every rank still holds the initial weights (its stage's, at pp2),
    # cast to fp16 as such, with untouched Adam state.
    tensors, state = checkpoint_contents(tmp_path / "ckpt" / f"iter_{leading:07d}")
    for name, w0 in init_weights.items():
        w = tensors[f"model/{name}"]
        assert torch.equal(w, w0.to(torch.float16)), f"{name} changed in a skipped step (or is not fp16(init))"
        assert torch.equal(tensors[f"optim/{name}/main_param"], w.float()), f"{name}: main copy is not the fp16 weight"
        for moment in ("exp_avg", "exp_avg_sq"):
            assert not tensors[f"optim/{name}/{moment}"].any(), f"{name}: {moment} moved in a skipped step"
    assert state["optimizer"]["step"] == 0
    assert state["optimizer"]["loss_scaler"]["scale"] == ref[leading - 1]["loss_scale"]
    # A rank that had stepped while the others skipped would also show in the losses after the skips and in the
    # final weights (these differ from the reference by 0 at 1 process and 0.0036 at pp2).
    compare_trajectory(log, fp16_reference, rtol, f"fp16 {layout}")
    check_final_weights(tmp_path / "ckpt", fp16_reference, init_weights, torch.float16, 0.02, f"fp16 {layout}")
