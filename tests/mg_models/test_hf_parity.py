"""Parity with Hugging Face: logits, greedy generations, export round trip (fp32, CPU).

Randomly initialised Hugging Face models are built from small configs, saved with
``save_pretrained``, loaded by mg from config.json + safetensors, and compared with the
Hugging Face model itself (the independent reference).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mg_models import load_pretrained
from mg_models.generation import SamplingConfig, generate
from mg_models.hf import read_hf_directory, write_hf_directory

VOCAB = 301  # not a multiple of 128: exercises vocabulary padding


def _gpt2(tied: bool) -> torch.nn.Module:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama(tied: bool, bias: bool, kv_heads: int = 2) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                                   tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias,
                                   rope_theta=5000.0, rms_norm_eps=1e-5)
    return transformers.LlamaForCausalLM(cfg)


def _mistral() -> torch.nn.Module:
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                                     sliding_window=None)
    return transformers.MistralForCausalLM(cfg)


CASES = {
    "gpt2-tied": lambda: _gpt2(True),
    "gpt2-untied": lambda: _gpt2(False),
    "llama-gqa": lambda: _llama(False, False),
    "llama-gqa-tied-bias": lambda: _llama(True, True),
    "llama-mha": lambda: _llama(False, False, kv_heads=4),
    "mistral-mqa": _mistral,
}


def _randomise_small_params(model: torch.nn.Module) -> None:
    # HF initialises norms to 1 and biases to 0; perturb them so their mapping is actually tested.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)


def save_case(name, make, tmp_path_factory, adjust=None):
    """``(name, hf model, directory)``: ``make()`` seeded, its 1-D parameters perturbed (then ``adjust(hf)``), saved."""
    torch.manual_seed(0)
    hf = make().eval()
    _randomise_small_params(hf)  # norms and biases, so their mapping is tested
    if adjust is not None:
        adjust(hf)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path, safe_serialization=True)
    return name, hf, path


def assert_exports_bit_exact(path, hf, out_dir, seq_len, name):
    """``path`` read and written back: the same tensors bit for bit, the same config, and transformers' logits of
    the re-exported directory equal ``hf``'s."""
    import json

    from safetensors.torch import load_file

    from mg_models.hf import config_from_hf, read_hf_directory, write_hf_directory

    config, state, model_type = read_hf_directory(path)
    out = write_hf_directory(out_dir, state, config, model_type)
    original, exported = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    assert config_from_hf(json.loads((out / "config.json").read_text())) == config
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf)
    ids = torch.randint(0, hf.config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits), name
    return config, state, model_type


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request, tmp_path_factory):
    return save_case(request.param, CASES[request.param], tmp_path_factory)


def test_logits_match(saved):
    name, hf, path = saved
    model = load_pretrained(path)
    ids = torch.randint(0, VOCAB, (3, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids)
    assert out.shape == ref.shape == (3, 19, VOCAB)
    assert (out - ref).abs().max().item() <= 1e-5, name
    # Per-token loss from the vocab-parallel cross entropy equals torch's on HF's logits.
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    with torch.no_grad():
        loss = model(ids, labels=labels)
    ref_loss = torch.nn.functional.cross_entropy(ref.flatten(0, 1), labels.flatten(), reduction="none").view(3, 19)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)


def test_greedy_generation_matches(saved):
    name, hf, path = saved
    model = load_pretrained(path)
    prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    new = 12
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, pad_token_id=0)
    ours = generate(model, prompt.tolist(), SamplingConfig(max_new_tokens=new))
    assert ours.tokens == ref[:, prompt.shape[1]:].tolist(), name


def test_export_round_trip(saved, tmp_path):
    name, hf, path = saved
    config, state, model_type = read_hf_directory(path)
    out = write_hf_directory(tmp_path / "export", state, config, model_type)
    original = load_file(str(path / "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    assert sorted(exported) == sorted(original), name
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and torch.equal(exported[key], value), key
    # The exported directory is a valid Hugging Face model with the same behaviour.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == model_type and cfg["vocab_size"] == VOCAB


def test_mg_model_exports_to_hf(tmp_path):
    """A model built by mg (own init, odd vocab) exports to a Hugging Face Llama with the same logits."""
    from mg_models import GPTModel, get_config

    config = get_config("tiny-llama", vocab_size=VOCAB, tie_word_embeddings=True)
    model = GPTModel(config, seed=7).eval()
    write_hf_directory(tmp_path, model.state_dict(), config, "llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = model(ids, gather_logits=True)
        ref = hf(ids).logits
    assert (ours - ref).abs().max().item() <= 1e-5


def test_sliding_window_matches_mistral(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     sliding_window=5)
    hf = transformers.MistralForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_pretrained(tmp_path)
    assert model.config.sliding_window == 5
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-5


def test_unsupported_checkpoints_name_the_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type='bert'"):
        load_pretrained(tmp_path)
    cfg = _llama(False, False).config.to_dict()
    cfg["hidden_act"] = "gelu"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_act"):
        load_pretrained(tmp_path)


def _check_streaming_groups(path, mg_model_of) -> None:
    """Group-by-group conversion (what `mg convert` streams): shapes planned on meta tensors equal the mg model's
    own parameters and the Hugging Face model's tensors, each read touches a few tensors, and the round trip is exact."""
    from mg_models.hf import converted_specs, hf_tensor_ignored, iter_converted, read_hf_config, tensor_groups

    hf_state = load_file(str(path / "model.safetensors"))
    config, model_type = read_hf_config(path, set(hf_state), hf_state.__getitem__)
    groups = tensor_groups(config, model_type)
    mg_specs = converted_specs(groups, lambda n: (hf_state[n].shape, hf_state[n].dtype), "mg")
    mg_params = {k: tuple(v.shape) for k, v in mg_model_of(config).state_dict().items()}
    assert {n: s for n, s, _ in mg_specs} == mg_params  # the model's own shapes: an independent reference
    reads = []

    def read_hf(names):
        reads.append(len(names))
        return {n: hf_state[n] for n in names}

    mg_state = dict(iter_converted(groups, read_hf, "mg"))
    assert max(reads) <= 3 and len(reads) == len(groups)
    assert [(n, tuple(t.shape), t.dtype) for n, t in mg_state.items()] == mg_specs
    planned = converted_specs(groups, lambda n: (mg_state[n].shape, mg_state[n].dtype), "hf")
    back = dict(iter_converted(groups, lambda names: {n: mg_state[n] for n in names}, "hf"))
    assert [(n, tuple(t.shape), t.dtype) for n, t in back.items()] == planned
    kept = {n: t for n, t in hf_state.items() if not hf_tensor_ignored(n, config, model_type)}
    assert sorted(back) == sorted(kept) and all(torch.equal(back[n], kept[n]) for n in kept)


def test_streaming_groups_plan_shapes_and_round_trip(saved):
    from mg_models import GPTModel

    _check_streaming_groups(saved[2], GPTModel)


@pytest.mark.parametrize("arch", ["bert", "bert-mlm", "t5-v1.0", "t5-v1.1"])
def test_streaming_groups_for_bert_and_t5(arch, tmp_path):
    from mg_models.bert import BertModel
    from mg_models.t5 import T5Model

    torch.manual_seed(0)
    if arch.startswith("bert"):
        cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=48, max_position_embeddings=64)
        hf = (transformers.BertForPreTraining if arch == "bert" else transformers.BertForMaskedLM)(cfg)
        model_of = BertModel
    else:
        v11 = arch == "t5-v1.1"
        cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=1,
                                    num_heads=4, feed_forward_proj="gated-gelu" if v11 else "relu",
                                    tie_word_embeddings=not v11)
        hf = transformers.T5ForConditionalGeneration(cfg)
        model_of = T5Model
    _randomise_small_params(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _check_streaming_groups(tmp_path, model_of)
