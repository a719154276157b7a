"""Generation: KV-cache decoding equals full recomputation, left padding, sampling controls, tp=2."""

from __future__ import annotations

import pytest
import torch

from mg_models import GPTModel, get_config
from mg_models.generation import InferenceCache, SamplingConfig, generate, sample_next
from mg_parallel.grid import ParallelDims, build_grid
from mg_parallel.testing import run_distributed

VOCAB = 301
PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [11, 12], [300, 1, 2, 3, 4]]


def _model(preset: str, seed: int = 3) -> GPTModel:
    config = get_config(preset, vocab_size=VOCAB, max_position_embeddings=64)
    return GPTModel(config, seed=seed).eval()


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_kv_cache_equals_full_recomputation_every_step(preset):
    model = _model(preset)
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, VOCAB, (2, 14), generator=gen)
    cache = InferenceCache(2, 14)
    with torch.no_grad():
        step_logits = [model(seq[:, :5], gather_logits=True, inference_cache=cache)]
        for t in range(5, 14):
            step_logits.append(model(seq[:, t:t + 1], gather_logits=True, inference_cache=cache))
        full = model(seq, gather_logits=True)
    cached = torch.cat(step_logits, dim=1)
    torch.testing.assert_close(cached, full, atol=2e-5, rtol=1e-5)
    assert cache.offset == 14


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_left_padded_batch_equals_each_prompt_alone(preset):
    model = _model(preset)
    cfg = SamplingConfig(max_new_tokens=8)
    batched = generate(model, PROMPTS, cfg)
    for i, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], cfg)
        assert batched.tokens[i] == alone.tokens[0]
        torch.testing.assert_close(torch.tensor(batched.logprobs[i]), torch.tensor(alone.logprobs[0]),
                                   atol=1e-5, rtol=1e-5)


def test_logprobs_and_greedy_against_plain_recomputation():
    """Reference: full forward over prompt + continuation, argmax and log_softmax in torch."""
    model = _model("tiny-llama")
    out = generate(model, [PROMPTS[0]], SamplingConfig(max_new_tokens=6))
    seq = torch.tensor([PROMPTS[0] + out.tokens[0]])
    with torch.no_grad():
        logits = model(seq, gather_logits=True)[0, len(PROMPTS[0]) - 1:-1]
    assert logits.argmax(-1).tolist() == out.tokens[0]
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(out.tokens[0])[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(out.logprobs[0]), expected, atol=1e-5, rtol=1e-5)


def test_stop_tokens_and_limits():
    model = _model("tiny-gpt2")
    free = generate(model, PROMPTS, SamplingConfig(max_new_tokens=6))
    assert all(len(t) == 6 for t in free.tokens)
    stop = free.tokens[0][2]
    stopped = generate(model, PROMPTS, SamplingConfig(max_new_tokens=6, stop_token_ids=[stop]))
    first = free.tokens[0].index(stop)
    assert stopped.tokens[0] == free.tokens[0][: first + 1]
    for row, full in zip(stopped.tokens, free.tokens):
        expected = full[: full.index(stop) + 1] if stop in full else full
        assert row == expected
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, PROMPTS, SamplingConfig(max_new_tokens=60))
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)


def test_sampling_controls():
    model = _model("tiny-llama")
    greedy = generate(model, PROMPTS, SamplingConfig(max_new_tokens=5))
    assert generate(model, PROMPTS, SamplingConfig(max_new_tokens=5, temperature=1.0, top_k=1)).tokens == greedy.tokens
    assert generate(model, PROMPTS, SamplingConfig(max_new_tokens=5, temperature=0.7, top_p=1e-6)).tokens == greedy.tokens
    a = generate(model, PROMPTS, SamplingConfig(max_new_tokens=5, temperature=1.0, seed=4))
    b = generate(model, PROMPTS, SamplingConfig(max_new_tokens=5, temperature=1.0, seed=4))
    assert a.tokens == b.tokens

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    topk = sample_next(logits, SamplingConfig(temperature=1.0, top_k=2), gen)
    assert set(topk.tolist()) == {0, 1}
    # top_p=0.75: {0.5, 0.3} reaches it, so token 2 and 3 are never drawn; 0 vs 1 in ratio 5:3.
    topp = sample_next(logits, SamplingConfig(temperature=1.0, top_p=0.75), gen)
    assert set(topp.tolist()) == {0, 1}
    assert abs((topp == 0).float().mean().item() - 0.625) < 0.04
    plain = sample_next(logits, SamplingConfig(temperature=1.0), gen)
    assert abs((plain == 3).float().mean().item() - 0.05) < 0.02


def tp_generate_worker(preset: str) -> list[list[int]]:
    torch.set_num_threads(1)
    grid = build_grid(ParallelDims(tp=2))
    config = get_config(preset, vocab_size=VOCAB, max_position_embeddings=64)
    model = GPTModel(config, grid, seed=3, sequence_parallel=False).eval()
    greedy = generate(model, PROMPTS, SamplingConfig(max_new_tokens=6)).tokens
    sampled = generate(model, PROMPTS, SamplingConfig(max_new_tokens=6, temperature=1.0, top_k=20, seed=2)).tokens
    return [greedy, sampled]


def test_tensor_parallel_generation_matches_single_process():
    ref_greedy = generate(_model("tiny-llama"), PROMPTS, SamplingConfig(max_new_tokens=6)).tokens
    ref_sampled = generate(_model("tiny-llama"), PROMPTS,
                           SamplingConfig(max_new_tokens=6, temperature=1.0, top_k=20, seed=2)).tokens
    results = run_distributed(tp_generate_worker, 2, "tiny-llama")
    for greedy, sampled in results:
        assert greedy == ref_greedy
        assert sampled == ref_sampled


def _t5(seed: int = 5, **overrides):
    from mg_models.t5 import T5Model, get_t5_config

    config = get_t5_config("tiny-t5", vocab_size=VOCAB, **overrides)
    model = T5Model(config, seed=seed).eval()
    model.gather_logits_default = True
    return model


@pytest.mark.parametrize("overrides", [{}, {"activation": "gated-gelu", "tie_word_embeddings": False}])
def test_seq2seq_greedy_and_logprobs_against_full_recomputation(overrides):
    """Reference: the whole decoder prefix through model(...) (teacher forcing, no cache), argmax in torch."""
    from mg_models.generation import generate_seq2seq

    model = _t5(**overrides)
    src = PROMPTS[0]
    out = generate_seq2seq(model, [src], SamplingConfig(max_new_tokens=7), decoder_start_token_id=0)
    dec = torch.tensor([[0] + out.tokens[0]])
    with torch.no_grad():
        logits = model(torch.tensor([src]), decoder_input_ids=dec[:, :-1], gather_logits=True)[0][0]
    assert logits.argmax(-1).tolist() == out.tokens[0]
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(out.tokens[0])[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(out.logprobs[0]), expected, atol=1e-5, rtol=1e-5)


def test_seq2seq_padded_batch_stop_tokens_and_sampling():
    from mg_models.generation import generate_seq2seq

    model = _t5()
    cfg = SamplingConfig(max_new_tokens=8)
    batched = generate_seq2seq(model, PROMPTS, cfg)
    for i, src in enumerate(PROMPTS):  # right padding is masked: each row decodes as it would alone
        alone = generate_seq2seq(model, [src], cfg)
        assert batched.tokens[i] == alone.tokens[0]
        torch.testing.assert_close(torch.tensor(batched.logprobs[i]), torch.tensor(alone.logprobs[0]),
                                   atol=1e-5, rtol=1e-5)
    stop = batched.tokens[0][2]
    first = batched.tokens[0].index(stop)
    stopped = generate_seq2seq(model, PROMPTS, SamplingConfig(max_new_tokens=8, stop_token_ids=(stop,)))
    assert stopped.tokens[0] == batched.tokens[0][: first + 1]
    for row, full in zip(stopped.tokens[1:], batched.tokens[1:]):
        assert row == full[: full.index(stop) + 1] if stop in full else row == full[: len(row)]
    # top_k=1 is greedy whatever the temperature; sampling is reproducible by seed and varies with it.
    assert generate_seq2seq(model, PROMPTS, SamplingConfig(max_new_tokens=8, temperature=2.0, top_k=1)).tokens \
        == batched.tokens
    hot = [generate_seq2seq(model, PROMPTS, SamplingConfig(max_new_tokens=16, temperature=3.0, seed=s)).tokens
           for s in (1, 1, 2)]
    assert hot[0] == hot[1] and hot[0] != hot[2]
    with pytest.raises(ValueError, match="at least one token"):
        generate_seq2seq(model, [[]], cfg)
    with pytest.raises(ValueError, match="encode/decode"):
        generate_seq2seq(_model("tiny-llama"), PROMPTS, cfg)


def test_model_from_state_builds_every_family():
    from mg_models import model_from_state
    from mg_models.bert import BertModel, get_bert_config

    t5 = _t5()
    copy = model_from_state(t5.config, t5.state_dict())
    src, dec = torch.tensor([PROMPTS[0]]), torch.tensor([[0, 4, 9]])
    with torch.no_grad():
        assert torch.equal(copy(src, decoder_input_ids=dec)[0], t5(src, decoder_input_ids=dec)[0])
    bert = BertModel(get_bert_config("tiny-bert", vocab_size=VOCAB), seed=2).eval()
    copy = model_from_state(bert.config, bert.state_dict())
    assert isinstance(copy, BertModel)
    with torch.no_grad():
        assert torch.equal(copy(src)[0], bert(src, gather_logits=True)[0])
    gpt = _model("tiny-gpt2")
    with torch.no_grad():
        assert torch.equal(model_from_state(gpt.config, gpt.state_dict())(src), gpt(src, gather_logits=True))
    with pytest.raises(ValueError, match="missing"):
        model_from_state(t5.config, {k: v for k, v in t5.state_dict().items() if "encoder" not in k})
