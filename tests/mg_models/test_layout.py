"""Layout invariance: the same seed gives the same global weights, logits, losses and gradients at tp=1,
tp=2, tp=2 + sequence parallel, and split into two pipeline stages (fed by hand via set_input_tensor).

The reference is the single-process tp=1 model (itself checked against Hugging Face in
test_hf_parity). Distributed runs use gloo on CPU.
"""

from __future__ import annotations

import pytest
import torch

from mg_models import GPTConfig, GPTModel, check_parallel
from mg_parallel.grid import ParallelDims, ProcessGrid, build_grid
from mg_parallel.testing import run_distributed

SEED = 11
B, S = 2, 8

CONFIGS = {
    # Llama style: rope (partial), rmsnorm, swiglu, GQA, qk-layernorm, untied, no bias.
    "llama": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  vocab_size=301, max_position_embeddings=32, position_embedding="rope", rotary_percent=0.5,
                  normalization="rmsnorm", activation="swiglu", add_bias_linear=False, qk_layernorm=True,
                  tie_word_embeddings=False),
    # GPT-2 style: learned positions, layernorm, gelu, biases, tied embeddings.
    "gpt2": dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=301, max_position_embeddings=32,
                 activation="gelu_tanh"),
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 301, (B, S), generator=gen)
    labels = torch.randint(0, 301, (B, S), generator=gen)
    labels[0, :2] = -100
    return ids, labels


def _run(model: GPTModel, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    logits = model(ids, gather_logits=True)
    loss = model(ids, labels=labels)
    loss.sum().backward()
    return {"logits": logits.detach(), "loss": loss.detach()}


def _full(t: torch.Tensor, param: torch.nn.Parameter, group) -> torch.Tensor:
    import torch.distributed as dist

    if not getattr(param, "tensor_parallel", False):
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def tp_worker(name: str) -> dict[str, object]:
    """On 2 ranks: tp=2 with and without sequence parallelism, and tp=2 split into two stages."""
    from mg_parallel.tensor_parallel import allreduce_sequence_parallel_grads

    torch.set_num_threads(1)
    grid = build_grid(ParallelDims(tp=2))
    config = GPTConfig(**CONFIGS[name])
    ids, labels = _batch()
    out: dict[str, object] = {}
    for sp in (False, True):
        model = GPTModel(config, grid, sequence_parallel=sp, seed=SEED)
        res = _run(model, ids, labels)
        allreduce_sequence_parallel_grads(model, grid.tp_group)
        res["params"] = {n: _full(p, p, grid.tp_group) for n, p in model.named_parameters()}
        res["grads"] = {n: _full(p.grad, p, grid.tp_group) for n, p in model.named_parameters()}
        res["sp_marked"] = sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False))
        out[f"sp={sp}"] = res
    out["chunked"] = {chunk: _mean_loss_grads(name, chunk, grid, sequence_parallel=True) for chunk in (None, 5)}
    stage0 = GPTModel(config, grid, pre_process=True, post_process=False, layer_range=(0, 1), seed=SEED,
                      sequence_parallel=True)
    stage1 = GPTModel(config, grid, pre_process=False, post_process=True, layer_range=(1, 2), seed=SEED,
                      sequence_parallel=True)
    with torch.no_grad():
        stage1.set_input_tensor(stage0(ids))
        out["pipeline_logits"] = stage1(ids, gather_logits=True)
    try:
        GPTModel(GPTConfig(**{**CONFIGS[name], "num_query_groups": 1}), grid)
        out["bad_tp"] = None
    except ValueError as e:
        out["bad_tp"] = str(e)
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp_and_sequence_parallel_match_single_process(name):
    config = GPTConfig(**CONFIGS[name])
    ids, labels = _batch()
    ref_model = GPTModel(config, ProcessGrid.single(), seed=SEED)
    ref = _run(ref_model, ids, labels)
    ref_params = dict(ref_model.named_parameters())
    results = run_distributed(tp_worker, 2, name)
    for rank_out in results:
        for sp in (False, True):
            res = rank_out[f"sp={sp}"]
            assert set(res["params"]) == set(ref_params)
            for n, p in ref_params.items():
                # Initialisation depends only on (seed, global name): bit-identical global tensors.
                assert torch.equal(res["params"][n], p.detach()), (sp, n)
                torch.testing.assert_close(res["grads"][n], p.grad, atol=1e-5, rtol=1e-4, msg=f"grad {n} sp={sp}")
            torch.testing.assert_close(res["logits"], ref["logits"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(res["loss"], ref["loss"], atol=1e-5, rtol=1e-5)
            assert (res["loss"][0, :2] == 0).all()
        marked = rank_out["sp=True"]["sp_marked"]
        assert any("input_layernorm" in n for n in marked) and any("final_layernorm" in n for n in marked)
        torch.testing.assert_close(rank_out["pipeline_logits"], ref["logits"], atol=1e-5, rtol=1e-5)
        _assert_same_loss_and_grads(rank_out["chunked"][5], rank_out["chunked"][None])
        assert "num_query_groups=1" in rank_out["bad_tp"] and "parallel.tp=2" in rank_out["bad_tp"]


def _mean_loss_grads(name: str, chunk: int | None, grid: ProcessGrid, sequence_parallel: bool = False) -> dict:
    """Per-token loss and the full gradient of every parameter of the mean loss, with
    model.cross_entropy_chunk_tokens=chunk."""
    from mg_parallel.tensor_parallel import allreduce_sequence_parallel_grads

    config = GPTConfig(**CONFIGS[name], cross_entropy_chunk_tokens=chunk)
    model = GPTModel(config, grid, sequence_parallel=sequence_parallel, seed=SEED)
    ids, labels = _batch()
    loss = model(ids, labels=labels)
    loss.mean().backward()
    if grid.tp_size == 1:
        return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}
    allreduce_sequence_parallel_grads(model, grid.tp_group)
    return {"loss": loss.detach(), "grads": {n: _full(p.grad, p, grid.tp_group) for n, p in model.named_parameters()}}


def _assert_same_loss_and_grads(got: dict, want: dict) -> None:
    """The chunked loss equals the whole-logits one: per-token loss and every parameter's gradient within 1e-6."""
    torch.testing.assert_close(got["loss"], want["loss"], atol=1e-6, rtol=1e-6)
    assert set(got["grads"]) == set(want["grads"])
    for n, g in want["grads"].items():
        torch.testing.assert_close(got["grads"][n], g, atol=1e-6, rtol=1e-6, msg=f"grad {n}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_chunked_cross_entropy_matches_whole_logits(name):
    """model.cross_entropy_chunk_tokens=5 (S*B = 16 tokens: no multiple) gives the per-token loss and parameter
    gradients of the whole-logits path (tied and untied heads); tp=2 with sequence parallelism runs in
    tp_worker."""
    chunked, whole = (_mean_loss_grads(name, chunk, ProcessGrid.single()) for chunk in (5, None))
    assert chunked["loss"].shape == (B, S) and (chunked["loss"][0, :2] == 0).all()
    _assert_same_loss_and_grads(chunked, whole)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pipeline_stages_equal_layers_of_full_model(name):
    config = GPTConfig(**CONFIGS[name])
    full = GPTModel(config, seed=SEED)
    stage0 = GPTModel(config, pre_process=True, post_process=False, layer_range=(0, 1), seed=SEED)
    stage1 = GPTModel(config, pre_process=False, post_process=True, layer_range=(1, 2), seed=SEED)
    full_params = dict(full.named_parameters())
    for stage in (stage0, stage1):
        for n, p in stage.named_parameters():
            # The last stage's own copy of a tied embedding starts equal to the first stage's.
            source = "embedding.word_embeddings.weight" if (n == "output_layer.weight" and config.tie_word_embeddings) else n
            assert torch.equal(p, full_params[source]), n
    if config.tie_word_embeddings:
        assert stage0.embedding.word_embeddings.weight.shared_embedding
        assert stage1.output_layer.weight.shared_embedding
    ids, labels = _batch()
    with torch.no_grad():
        hidden = stage0(ids)
        assert hidden.shape == (S, B, config.hidden_size)
        stage1.set_input_tensor(hidden)
        torch.testing.assert_close(stage1(ids, labels=labels), full(ids, labels=labels), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="set_input_tensor"):
        GPTModel(config, pre_process=False, layer_range=(1, 2))(ids)


def test_bad_configs_name_the_fields():
    base = CONFIGS["llama"]
    with pytest.raises(ValueError, match="num_query_groups"):
        GPTConfig(**{**base, "num_query_groups": 3})
    with pytest.raises(ValueError, match="hidden_size=66.*num_attention_heads"):
        GPTConfig(**{**base, "hidden_size": 66})
    with pytest.raises(ValueError, match="num_query_groups=2 is not divisible by parallel.tp=4"):
        check_parallel(GPTConfig(**{**base, "num_attention_heads": 8}), tp=4)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by parallel.tp=8"):
        check_parallel(GPTConfig(**base), tp=8)
    with pytest.raises(ValueError, match="position_embedding"):
        GPTConfig(**{**base, "position_embedding": "alibi"})
    with pytest.raises(ValueError, match="model.cross_entropy_chunk_tokens"):
        GPTConfig(**{**base, "cross_entropy_chunk_tokens": 0})
    with pytest.raises(ValueError, match="layer_range"):
        GPTModel(GPTConfig(**base), layer_range=(1, 5))


def test_recompute_with_dropout_gives_identical_gradients():
    """Full-layer and core-attention recompute replay dropout exactly (reference: no recompute)."""
    from mg_parallel.recompute import RecomputeConfig
    from mg_parallel.tensor_parallel import RNGTracker

    config = GPTConfig(**{**CONFIGS["llama"], "hidden_dropout": 0.2, "attention_dropout": 0.2})
    ids, labels = _batch()
    grid = ProcessGrid.single()
    results = {}
    for granularity in (None, "full", "selective"):
        tracker = RNGTracker(5, grid)
        model = GPTModel(config, grid, seed=SEED, rng_tracker=tracker,
                         recompute=RecomputeConfig(granularity=granularity)).train()
        loss = model(ids, labels=labels)
        loss.sum().backward()
        results[granularity] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    eval_loss = GPTModel(config, grid, seed=SEED).eval()(ids, labels=labels)
    assert not torch.allclose(results[None][0], eval_loss)  # dropout was active
    for granularity in ("full", "selective"):
        torch.testing.assert_close(results[granularity][0], results[None][0], atol=0, rtol=0)
        for n, g in results[None][1].items():
            torch.testing.assert_close(results[granularity][1][n], g, atol=1e-6, rtol=1e-5, msg=n)


def ddp_worker(name: str) -> dict[str, torch.Tensor]:
    """tp=2 (sequence parallel) x dp=2 under mg's DDP wrapper: each dp rank trains on half the batch."""
    from mg_parallel.distributed import DistributedDataParallel, finalize_model_grads

    torch.set_num_threads(1)
    grid = build_grid(ParallelDims(tp=2, dp=2))
    config = GPTConfig(**CONFIGS[name])
    model = DistributedDataParallel(GPTModel(config, grid, sequence_parallel=True, seed=SEED), grid)
    ids, labels = _batch()
    mine = slice(grid.dp_rank, grid.dp_rank + 1)  # B = 2: one sequence per dp rank
    loss = model(ids[mine], labels=labels[mine])
    (loss.sum() / labels.numel()).mul(grid.dp_size).backward()  # DDP averages over dp
    finalize_model_grads([model], grid)
    return {n: _full(p.main_grad, p, grid.tp_group) for n, p in model.module.named_parameters()}


def test_ddp_wrapper_with_tp_and_sequence_parallel_matches_single_process():
    name = "gpt2"  # tied embeddings, biases: exercises the row-parallel bias and norm grad fix-ups
    config = GPTConfig(**CONFIGS[name])
    ids, labels = _batch()
    ref = GPTModel(config, seed=SEED)
    (ref(ids, labels=labels).sum() / labels.numel()).backward()
    for grads in run_distributed(ddp_worker, 4, name):
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)
