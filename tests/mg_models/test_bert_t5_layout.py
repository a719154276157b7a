"""BERT and T5 layout invariance: tp=2 (and tp=2 + sequence parallel, and two pipeline stages for BERT)
give the global weights, outputs and gradients of the single-process tp=1 model (gloo on CPU).

The tp=1 models are themselves checked against Hugging Face in test_bert_t5_hf.
"""

from __future__ import annotations

import pytest
import torch

from mg_models.bert import BertConfig, BertModel, get_bert_config
from mg_models.t5 import T5Config, T5Model, greedy_generate
from mg_parallel.grid import ParallelDims, ProcessGrid, build_grid
from mg_parallel.testing import run_distributed

SEED = 7
B, S, T = 2, 8, 6
BERT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=301,
            max_position_embeddings=16)
T5 = dict(num_layers=2, num_decoder_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8, ffn_hidden_size=48,
          vocab_size=301, relative_attention_num_buckets=8, relative_attention_max_distance=10)


def _bert_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 5:] = 0
    labels = torch.full((B, S), -100)
    labels[:, 1:4] = torch.randint(0, 301, (B, 3), generator=gen)
    return dict(ids=torch.randint(0, 301, (B, S), generator=gen), types=torch.randint(0, 2, (B, S), generator=gen),
                mask=mask, labels=labels)


def _bert_run(model: BertModel) -> dict[str, torch.Tensor]:
    d = _bert_batch()
    logits, binary = model(d["ids"], d["types"], d["mask"], gather_logits=True)
    loss, binary2 = model(d["ids"], d["types"], d["mask"], lm_labels=d["labels"])
    (loss.sum() + binary2.square().sum()).backward()
    return {"logits": logits.detach(), "binary": binary.detach(), "loss": loss.detach()}


def _t5_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, 6:] = 0
    return dict(ids=torch.randint(0, 301, (B, S), generator=gen), dec=torch.randint(0, 301, (B, T), generator=gen),
                labels=torch.randint(0, 301, (B, T), generator=gen), mask=mask)


def _t5_run(model: T5Model) -> dict[str, torch.Tensor]:
    d = _t5_batch()
    logits, _ = model(d["ids"], d["dec"], d["mask"], gather_logits=True)
    loss, _ = model(d["ids"], d["dec"], d["mask"], labels=d["labels"])
    loss.sum().backward()
    return {"logits": logits.detach(), "loss": loss.detach()}


def _full(t: torch.Tensor, param: torch.nn.Parameter, group) -> torch.Tensor:
    import torch.distributed as dist

    if not getattr(param, "tensor_parallel", False):
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def _collect(model: torch.nn.Module, grid) -> dict[str, dict[str, torch.Tensor]]:
    from mg_parallel.tensor_parallel import allreduce_sequence_parallel_grads

    allreduce_sequence_parallel_grads(model, grid.tp_group)
    return {"params": {n: _full(p, p, grid.tp_group) for n, p in model.named_parameters()},
            "grads": {n: _full(p.grad, p, grid.tp_group) for n, p in model.named_parameters()}}


def tp_worker(pre_layernorm: bool) -> dict[str, object]:
    """On 2 ranks: BERT at tp=2 without/with sequence parallelism and as two tp=2+sp stages; T5 at tp=2
    (training step and KV-cache greedy decoding)."""
    torch.set_num_threads(1)
    grid = build_grid(ParallelDims(tp=2))
    config = BertConfig(**BERT, pre_layernorm=pre_layernorm)
    out: dict[str, object] = {}
    for sp in (False, True):
        model = BertModel(config, grid, sequence_parallel=sp, seed=SEED)
        out[f"bert sp={sp}"] = {**_bert_run(model), **_collect(model, grid)}
    d = _bert_batch()
    stage0 = BertModel(config, grid, post_process=False, layer_range=(0, 1), sequence_parallel=True, seed=SEED)
    stage1 = BertModel(config, grid, pre_process=False, layer_range=(1, 2), sequence_parallel=True, seed=SEED)
    with torch.no_grad():
        stage1.set_input_tensor(stage0(d["ids"], d["types"], d["mask"]))
        out["bert pipeline"] = stage1(None, None, d["mask"], gather_logits=True)
    if not pre_layernorm:
        t5 = T5Model(T5Config(**T5, activation="gated-gelu", tie_word_embeddings=False), grid, seed=SEED)
        out["t5"] = {**_t5_run(t5), **_collect(t5, grid)}
        d5 = _t5_batch()
        out["t5 greedy"] = greedy_generate(t5.eval(), d5["ids"], 5, attention_mask=d5["mask"])
    return out


def _compare(res: dict, ref: dict, ref_model: torch.nn.Module, what: str) -> None:
    ref_params = dict(ref_model.named_parameters())
    assert set(res["params"]) == set(ref_params), what
    for n, p in ref_params.items():
        # Initialisation depends only on (seed, global name): bit-identical global tensors.
        assert torch.equal(res["params"][n], p.detach()), (what, n)
        torch.testing.assert_close(res["grads"][n], p.grad, atol=1e-5, rtol=1e-4, msg=f"{what} grad {n}")
    for key in ("logits", "loss", "binary"):
        if key in ref:
            torch.testing.assert_close(res[key], ref[key], atol=1e-5, rtol=1e-5, msg=f"{what} {key}")


@pytest.mark.parametrize("pre_layernorm", [False, True])
def test_tp_sequence_parallel_and_pipeline_match_single_process(pre_layernorm):
    config = BertConfig(**BERT, pre_layernorm=pre_layernorm)
    ref_model = BertModel(config, ProcessGrid.single(), seed=SEED)
    ref = _bert_run(ref_model)
    t5_ref_model = T5Model(T5Config(**T5, activation="gated-gelu", tie_word_embeddings=False), seed=SEED)
    t5_ref = _t5_run(t5_ref_model)
    for rank_out in run_distributed(tp_worker, 2, pre_layernorm):
        for sp in (False, True):
            _compare(rank_out[f"bert sp={sp}"], ref, ref_model, f"bert sp={sp}")
        logits, binary = rank_out["bert pipeline"]
        torch.testing.assert_close(logits, ref["logits"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(binary, ref["binary"], atol=1e-5, rtol=1e-5)
        if not pre_layernorm:
            _compare(rank_out["t5"], t5_ref, t5_ref_model, "t5")
            # KV-cache decoding with heads split over tp picks the same tokens.
            d5 = _t5_batch()
            assert torch.equal(rank_out["t5 greedy"], greedy_generate(t5_ref_model.eval(), d5["ids"], 5,
                                                                      attention_mask=d5["mask"]))


def test_bert_pipeline_stages_equal_layers_of_full_model():
    config = BertConfig(**BERT)
    full = BertModel(config, seed=SEED)
    stage0 = BertModel(config, post_process=False, layer_range=(0, 1), seed=SEED)
    stage1 = BertModel(config, pre_process=False, layer_range=(1, 2), seed=SEED)
    full_params = dict(full.named_parameters())
    for stage in (stage0, stage1):
        for n, p in stage.named_parameters():
            # The last stage's own copy of the tied embedding starts equal to the first stage's.
            source = "embedding.word_embeddings.weight" if n == "output_layer.weight" else n
            assert torch.equal(p, full_params[source]), n
    assert stage0.embedding.word_embeddings.weight.shared_embedding and stage1.output_layer.weight.shared_embedding
    d = _bert_batch()
    with torch.no_grad():
        hidden = stage0(d["ids"], d["types"], d["mask"])
        assert hidden.shape == (S, B, config.hidden_size)
        stage1.set_input_tensor(hidden)
        loss, binary = stage1(None, None, d["mask"], lm_labels=d["labels"])
        ref_loss, ref_binary = full(d["ids"], d["types"], d["mask"], lm_labels=d["labels"])
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(binary, ref_binary, atol=1e-6, rtol=1e-6)
    assert (loss[:, 0] == 0).all() and (loss[:, 1:4] > 0).all()
    with pytest.raises(ValueError, match="set_input_tensor"):
        BertModel(config, pre_process=False, layer_range=(1, 2))(d["ids"])


def test_bert_bad_configs_name_the_fields():
    with pytest.raises(ValueError, match="model.position_embedding='rope'"):
        BertConfig(**BERT, position_embedding="rope")
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        BertConfig(**BERT, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="type_vocab_size"):
        BertConfig(**BERT, type_vocab_size=-1)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by parallel.tp=8"):
        from mg_models.config import check_parallel

        check_parallel(BertConfig(**BERT), tp=8)
    with pytest.raises(ValueError, match="unknown BERT preset"):
        get_bert_config("bert-huge")
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        BertModel(BertConfig(**BERT))(torch.zeros(1, 20, dtype=torch.long))
    assert get_bert_config("bert-base").hidden_size == 768


class _FakeGrid:
    """Just the grid fields T5Model reads before any communication (a real pp=2 grid needs two ranks)."""

    def __init__(self, tp: int, pp: int) -> None:
        self.tp_size, self.pp_size, self.tp_group, self.tp_rank, self.device = tp, pp, None, 0, None


def test_t5_refuses_bad_tp_and_too_many_stages():
    with pytest.raises(ValueError, match="model.num_attention_heads=4 is not divisible by parallel.tp=3"):
        T5Model(T5Config(**T5), _FakeGrid(tp=3, pp=1))
    with pytest.raises(ValueError, match=r"the 4 encoder and decoder layers .* cannot fill parallel.pp=5"):
        T5Model(T5Config(**T5), _FakeGrid(tp=1, pp=5))


@pytest.mark.parametrize("layers, cuts, tied", [
    ((2, 2), [(0, 2), (2, 4)], True),  # encoder | decoder
    ((3, 1), [(0, 2), (2, 4)], False),  # the second stage ends the encoder and runs the decoder (untied head)
    ((2, 2), [(0, 1), (1, 2), (2, 3), (3, 4)], True),  # one layer per stage
])
def test_t5_pipeline_stages_chain_to_the_whole_model(layers, cuts, tied):
    """T5 cut into pipeline stages and chained by hand (each stage's output the next one's input tensor) gives the
    whole model's per-token loss, and the gradients of its parameters summed over the stages that hold them (the
    position bias tables on every stage, a tied embedding on the first and last), at fp32 round-off."""
    config = T5Config(**{**T5, "num_layers": layers[0], "num_decoder_layers": layers[1]},
                      activation="relu" if tied else "gated-gelu", tie_word_embeddings=tied)
    whole = T5Model(config, seed=SEED)
    stages = [T5Model(config, _FakeGrid(tp=1, pp=len(cuts)), pre_process=i == 0, post_process=i == len(cuts) - 1,
                      layer_range=cut, seed=SEED) for i, cut in enumerate(cuts)]
    d = _t5_batch()
    expected, _ = whole(d["ids"], d["dec"], d["mask"], labels=d["labels"])
    (expected * torch.linspace(0.5, 1.5, T)).sum().backward()
    x = None
    for stage in stages:
        stage.set_input_tensor(x)
        x = stage(d["ids"], d["dec"], d["mask"], labels=d["labels"])
        if stage is not stages[-1]:
            assert x.shape == (S + T, B, config.hidden_size)
    loss, memory = x
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert memory.shape == (S, B, config.hidden_size)
    (loss * torch.linspace(0.5, 1.5, T)).sum().backward()

    reference = dict(whole.named_parameters())
    summed: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            source = "word_embeddings.weight" if tied and name == "output_layer.weight" else name
            torch.testing.assert_close(p.detach(), reference[source].detach(), rtol=0, atol=0)  # same init
            summed[source] = summed.get(source, 0) + (p.grad if p.grad is not None else torch.zeros_like(p))
            if "relative_attention_bias" in name:
                assert getattr(p, "pipeline_replicated", False), name
            if source == "word_embeddings.weight":
                assert getattr(p, "shared_embedding", False) == tied, name
    assert sorted(summed) == sorted(reference)
    for name, grad in summed.items():
        torch.testing.assert_close(grad, reference[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    tables = [dict(st.named_parameters())["encoder.relative_attention_bias.weight"] for st in stages]
    # Only the stages with encoder layers use the encoder's table.
    assert sum(t.grad is not None for t in tables) == len([c for c in cuts if c[0] < layers[0]])


def test_bert_recompute_with_dropout_gives_identical_gradients():
    """Full-layer recompute replays BERT's dropout exactly (reference: the same model without recompute)."""
    from mg_parallel.recompute import RecomputeConfig
    from mg_parallel.tensor_parallel import RNGTracker

    config = BertConfig(**BERT, hidden_dropout=0.2, attention_dropout=0.2)
    d = _bert_batch()
    grid = ProcessGrid.single()
    results = {}
    for granularity in (None, "full"):
        torch.manual_seed(0)
        model = BertModel(config, grid, seed=SEED, rng_tracker=RNGTracker(5, grid),
                          recompute=RecomputeConfig(granularity=granularity)).train()
        loss, binary = model(d["ids"], d["types"], d["mask"], lm_labels=d["labels"])
        (loss.sum() + binary.sum()).backward()
        results[granularity] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    eval_loss, _ = BertModel(config, grid, seed=SEED).eval()(d["ids"], d["types"], d["mask"], lm_labels=d["labels"])
    assert not torch.allclose(results[None][0], eval_loss)  # dropout was active
    torch.testing.assert_close(results["full"][0], results[None][0], atol=0, rtol=0)
    for n, g in results[None][1].items():
        torch.testing.assert_close(results["full"][1][n], g, atol=1e-6, rtol=1e-5, msg=n)
