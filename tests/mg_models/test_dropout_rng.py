"""Dropout masks across tensor-parallel sizes (the RNG tracker's promise, Megatron's scheme).

Dropout in replicated regions (the embedding output and the residual branches, without sequence
parallelism) draws from the default generator, seeded alike on every tp rank, so it draws the same masks
whatever tp is: a tp=2 GPT in train mode gives the tp=1 GPT's loss and logits. Dropout inside a
tensor-parallel region (attention probabilities of this rank's heads) draws from the tracker's
per-tp-rank stream, so the two ranks' masks differ, and those draws leave the default stream alone.

Masks are observed where the model draws them: ``F.dropout`` and ``F.scaled_dot_product_attention`` are
wrapped to record the keep-masks drawn from whatever generator is in effect at the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from mg_models import GPTConfig, GPTModel
from mg_parallel.grid import ParallelDims, ProcessGrid, build_grid
from mg_parallel.tensor_parallel import RNGTracker
from mg_parallel.testing import run_distributed

INIT_SEED, RNG_SEED = 11, 1234
B, S = 2, 8
CONFIG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=301, max_position_embeddings=32,
              activation="gelu_tanh")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, 301, (B, S), generator=gen), torch.randint(0, 301, (B, S), generator=gen)


@contextlib.contextmanager
def _recording(masks: list[tuple[str, torch.Tensor]]) -> Iterator[None]:
    """Record ("hidden", keep) for each F.dropout and ("attention", keep [b, heads, s, s]) for each attention
    with dropout, drawn from the generator in effect at the call (attention is then computed with that mask)."""
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def recording_dropout(x, p=0.5, training=True, inplace=False):
        out = dropout(x, p, training, inplace)
        if training and p > 0:
            masks.append(("hidden", (out != 0).cpu()))
        return out

    def recording_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if dropout_p == 0:
            return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, **kwargs)
        assert attn_mask is None and is_causal, "this probe handles plain causal attention"
        keep = dropout(torch.ones(*q.shape[:-1], k.shape[-2], device=q.device), dropout_p) != 0
        masks.append(("attention", keep.cpu()))
        scores = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)  # [b, heads, s, s]
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return (probs * keep / (1 - dropout_p)) @ v

    F.dropout, F.scaled_dot_product_attention = recording_dropout, recording_sdpa
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout, sdpa


def _train_step_outputs(config: GPTConfig, grid: ProcessGrid) -> dict[str, object]:
    """Loss and logits of one train-mode forward each, every draw recorded, from a freshly seeded tracker."""
    tracker = RNGTracker(RNG_SEED, grid)
    model = GPTModel(config, grid, seed=INIT_SEED, rng_tracker=tracker).train()
    ids, labels = _batch()
    out: dict[str, object] = {}
    for what in ("loss", "logits"):
        # Seed the default stream and the forked ones as a run starting here would (model building drew
        # from the default generator, differently at each tp).
        tracker.set_state(RNGTracker(RNG_SEED, grid).get_state())
        masks: list[tuple[str, torch.Tensor]] = []
        with torch.no_grad(), _recording(masks):
            result = model(ids, labels=labels) if what == "loss" else model(ids, gather_logits=True)
        out[what], out[f"{what}_masks"] = result.cpu(), masks
    model.eval()
    with torch.no_grad():
        out["eval_loss"] = model(ids, labels=labels).cpu()
    return out


def tp_worker(attention_dropout: float) -> dict[str, object]:
    """On 2 ranks: the tp=1 model (each rank alone) and the tp=2 model, same seeds and weights."""
    torch.set_num_threads(1)
    grid = build_grid(ParallelDims(tp=2))
    config = GPTConfig(**CONFIG, hidden_dropout=0.2, attention_dropout=attention_dropout)
    return {"tp1": _train_step_outputs(config, ProcessGrid.single(grid.device)),
            "tp2": _train_step_outputs(config, grid)}


def _of(masks: list[tuple[str, torch.Tensor]], kind: str) -> list[torch.Tensor]:
    return [m for k, m in masks if k == kind]


@pytest.fixture(scope="module")
def hidden_only():
    return run_distributed(tp_worker, 2, 0.0)


def test_replicated_dropout_is_the_same_at_tp1_and_tp2(hidden_only):
    for rank, res in enumerate(hidden_only):
        tp1, tp2 = res["tp1"], res["tp2"]
        # Dropout is on and changes the result, so equal results below mean equal masks.
        assert not torch.allclose(tp1["loss"], tp1["eval_loss"], atol=1e-3), "train-mode dropout had no effect"
        torch.testing.assert_close(tp2["loss"], tp1["loss"], atol=1e-5, rtol=1e-5, msg=f"rank {rank} loss")
        torch.testing.assert_close(tp2["logits"], tp1["logits"], atol=1e-5, rtol=1e-5, msg=f"rank {rank} logits")
        for what in ("loss", "logits"):
            m1, m2 = _of(tp1[f"{what}_masks"], "hidden"), _of(tp2[f"{what}_masks"], "hidden")
            assert len(m1) == len(m2) == 1 + 2 * CONFIG["num_layers"]  # embedding + two branches per layer
            assert all(torch.equal(a, b) for a, b in zip(m1, m2)), f"rank {rank}: hidden masks differ across tp"
            assert not _of(tp2[f"{what}_masks"], "attention")


def test_attention_dropout_uses_per_rank_streams_and_leaves_replicated_masks_alone():
    results = run_distributed(tp_worker, 2, 0.3)
    for kind in ("loss", "logits"):
        per_rank = [_of(res["tp2"][f"{kind}_masks"], "attention") for res in results]
        assert [len(m) for m in per_rank] == [CONFIG["num_layers"]] * 2
        for layer, (r0, r1) in enumerate(zip(*per_rank)):
            assert r0.shape == (B, CONFIG["num_attention_heads"] // 2, S, S)
            assert 0.55 < r0.float().mean() < 0.85  # a keep-probability of 0.7 was drawn
            # Each rank holds different heads: their masks come from different streams.
            assert not torch.equal(r0, r1), f"layer {layer}: both tp ranks drew the same attention mask"
        # The default stream is untouched by those draws: replicated masks still agree across ranks and tp.
        reference = _of(results[0]["tp1"][f"{kind}_masks"], "hidden")
        for res in results:
            hidden = _of(res["tp2"][f"{kind}_masks"], "hidden")
            assert len(hidden) == len(reference) and all(torch.equal(a, b) for a, b in zip(hidden, reference))
