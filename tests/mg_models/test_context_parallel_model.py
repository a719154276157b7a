"""GPT with the sequence split over two context-parallel ranks against the same model on one process.

Each cp rank feeds its load-balanced part of every sample (chunks r and 2cp-1-r, ``split_for_cp``) and gets
its tokens' logits and per-token losses; the loss over the whole sequence is the sum of the ranks' masked sums
over the total count, and each parameter's gradient is the sum of the ranks' (the trainer's data-parallel
average over dp x cp, times cp). Checked for every cp_comm, for a Llama-style model (rope, GQA, qk-layernorm,
a sliding window) and a GPT-2-style one (learned positions, tied embeddings), and for packed documents.
"""

from __future__ import annotations

import pytest
import torch

from mg_models import GPTConfig, GPTModel
from mg_parallel.grid import ParallelDims, ProcessGrid, build_grid
from mg_parallel.testing import run_distributed

SEED = 5
B, S = 2, 16
COMMS = ("p2p", "allgather", "a2a")

CONFIGS = {
    "llama-window": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                         vocab_size=301, max_position_embeddings=32, position_embedding="rope", rotary_percent=0.5,
                         normalization="rmsnorm", activation="swiglu", add_bias_linear=False, qk_layernorm=True,
                         tie_word_embeddings=False, sliding_window=6),
    "gpt2": dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=301, max_position_embeddings=32,
                 activation="gelu_tanh"),
}


def _batch(packed: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    out = {"ids": torch.randint(0, 301, (B, S), generator=gen), "labels": torch.randint(0, 301, (B, S), generator=gen),
           "loss_mask": (torch.rand(B, S, generator=gen) > 0.2).float()}
    if packed:  # documents of lengths 5, 7, 4 and 9, 7 (they cross the chunk boundaries)
        out["document_ids"] = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])
    return out


def _reference(name: str, packed: bool) -> dict[str, object]:
    batch = _batch(packed)
    model = GPTModel(GPTConfig(**CONFIGS[name]), ProcessGrid.single(torch.device("cpu")), seed=SEED)
    docs = batch.get("document_ids")
    logits = model(batch["ids"], document_ids=docs, gather_logits=True).detach()
    per_token = model(batch["ids"], labels=batch["labels"], document_ids=docs)
    loss = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    return {"logits": logits, "per_token": per_token.detach(), "loss": loss.detach(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def cp_worker(name: str, packed: bool) -> dict[str, object]:
    """On 2 ranks at cp=2: each comm's gathered logits and per-token losses, the loss and the summed grads."""
    import torch.distributed as dist

    from mg_parallel.context_parallel import gather_from_cp, split_for_cp

    torch.set_num_threads(1)
    batch = _batch(packed)
    out: dict[str, object] = {}
    for comm in COMMS:
        grid = build_grid(ParallelDims(cp=2, cp_comm=comm))
        local = {k: split_for_cp(v, grid.cp_rank, 2).to(grid.device) for k, v in batch.items()}
        model = GPTModel(GPTConfig(**CONFIGS[name]), grid, seed=SEED)
        docs = local.get("document_ids")
        logits = model(local["ids"], document_ids=docs, gather_logits=True).detach()
        per_token = model(local["ids"], labels=local["labels"], document_ids=docs)
        count = local["loss_mask"].sum()
        dist.all_reduce(count, group=grid.cp_group)
        loss = (per_token * local["loss_mask"]).sum() / count
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=grid.cp_group)
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g, group=grid.cp_group)
            grads[n] = g.cpu()
        out[comm] = {"logits": gather_from_cp(logits, grid.cp_group, 1).cpu(),
                     "per_token": gather_from_cp(per_token.detach(), grid.cp_group, 1).cpu(),
                     "loss": total.cpu(), "grads": grads}
    return out


@pytest.mark.parametrize(("name", "packed"), [("llama-window", False), ("gpt2", False), ("llama-window", True)])
def test_cp2_matches_one_process(name, packed):
    ref = _reference(name, packed)
    results = run_distributed(cp_worker, 2, name, packed)
    for rank, res in enumerate(results):
        for comm in COMMS:
            got, what = res[comm], f"{name} packed={packed} cp_comm={comm} rank {rank}"
            torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-5, atol=1e-5, msg=what)
            torch.testing.assert_close(got["per_token"], ref["per_token"], rtol=1e-5, atol=1e-5, msg=what)
            torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6, msg=what)
            assert got["grads"].keys() == ref["grads"].keys()
            for n, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][n], g, rtol=1e-5, atol=1e-6, msg=f"{what}: grad of {n}")


def unsupported_worker() -> list[str]:
    """What a cp=2 GPT with a2a refuses, as the messages it raises."""
    torch.set_num_threads(1)
    grid = build_grid(ParallelDims(cp=2, cp_comm="a2a"))
    messages = []
    for fields in ({"attention_dropout": 0.1}, {"num_attention_heads": 3, "hidden_size": 48}):
        try:
            GPTModel(GPTConfig(**{**CONFIGS["gpt2"], **fields}), grid, seed=SEED)
        except ValueError as e:
            messages.append(str(e))
    model = GPTModel(GPTConfig(**CONFIGS["gpt2"]), grid, seed=SEED)
    ids = torch.zeros(B, S // 2, dtype=torch.long)
    try:
        model(ids, attention_mask=torch.ones(B, S // 2))
    except ValueError as e:
        messages.append(str(e))
    return messages


def test_cp2_rejects_what_it_cannot_do():
    messages = run_distributed(unsupported_worker, 2)[0]
    assert len(messages) == 3, messages
    assert "model.attention_dropout" in messages[0] and "parallel.cp_comm=a2a" in messages[0]  # a2a: no dropout
    assert "parallel.cp_comm=a2a" in messages[1] and "model.num_attention_heads" in messages[1]
    assert "attention_mask" in messages[2] and "parallel.cp" in messages[2]


LONG = 131072
LONG_CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, vocab_size=97,
                   max_position_embeddings=LONG, position_embedding="rope", rotary_base=500000.0,
                   rotary_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192},
                   normalization="rmsnorm", activation="swiglu", add_bias_linear=False, sliding_window=8)
# Spans of positions checked: across the boundary of chunks 6 (cp rank 1) and 7 (rank 0) of 8, and the end.
SPANS = ((7 * LONG // 8 - 32, 7 * LONG // 8 + 32), (LONG - 64, LONG))


def _long_ids() -> torch.Tensor:
    return torch.randint(0, 97, (1, LONG), generator=torch.Generator().manual_seed(11))


def long_context_worker() -> list[torch.Tensor]:
    """At cp=4: one forward over all 131072 positions; the logits of each span of SPANS."""
    from mg_parallel.context_parallel import gather_from_cp, split_for_cp

    torch.set_num_threads(1)
    grid = build_grid(ParallelDims(cp=4))
    model = GPTModel(GPTConfig(**LONG_CONFIG), grid, seed=SEED)
    with torch.no_grad():
        logits = model(split_for_cp(_long_ids(), grid.cp_rank, 4).to(grid.device), gather_logits=True)
    logits = gather_from_cp(logits, grid.cp_group, 1).cpu()
    return [logits[:, a:b].clone() for a, b in SPANS]


def test_forward_over_131072_positions_at_cp4():
    """With a sliding window of w over L layers a token depends on the L*(w-1) tokens before it and on no others, so
    one process running only those tokens, at their global positions, gives the logits of a span exactly, however
    the rest of the 131072 positions are computed."""
    got = run_distributed(long_context_worker, 4, timeout=300)
    c = LONG_CONFIG
    model = GPTModel(GPTConfig(**c), ProcessGrid.single(torch.device("cpu")), seed=SEED)
    reach = c["num_layers"] * (c["sliding_window"] - 1)
    for i, (a, b) in enumerate(SPANS):
        positions = torch.arange(a - reach, b).unsqueeze(0)
        with torch.no_grad():
            ref = model(_long_ids()[:, a - reach:b], position_ids=positions, gather_logits=True)[:, reach:]
        for rank, spans in enumerate(got):
            torch.testing.assert_close(spans[i], ref, rtol=1e-5, atol=1e-5, msg=f"positions {a}..{b} on rank {rank}")
