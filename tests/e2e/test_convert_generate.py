"""`mg convert` both ways against Hugging Face `transformers`, then `mg generate` / `mg inspect` on the result."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.conftest import mg

transformers = pytest.importorskip("transformers")


def _hf_tensors(path):
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(str(path / f)))
    return out


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_round_trip_through_mg_checkpoint(arch, tmp_path):
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=301, n_positions=64, n_embd=48, n_layer=2, n_head=4)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=301, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    model.eval()
    src = tmp_path / "hf"
    model.save_pretrained(src, safe_serialization=True)

    mg("convert", "--from", "hf", "--input", str(src), "--output", str(tmp_path / "ckpt"), "--tp", "2")
    inspect = mg("inspect", str(tmp_path / "ckpt")).stdout
    assert "iteration 0" in inspect and "checksums verified" in inspect
    mg("convert", "--to", "hf", "--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "back"))

    original, back = _hf_tensors(src), _hf_tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)
    for name, t in original.items():
        assert torch.equal(back[name], t), name
    reloaded = type(model).from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, 301, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_generate_from_hf_directory_matches_transformers(tmp_path, corpus):
    """Greedy `mg generate --json` ids equal `transformers` generate on the same random model."""
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    out = mg("generate", "--checkpoint", str(tmp_path / "hf"), "--tokenizer-model", str(corpus["tokenizer"]),
             "--prompt", "def main():", "--max-new-tokens", "8", "--no-stop-at-eod", "--json").stdout
    row = json.loads(out)[0]
    ids = torch.tensor([row["prompt_ids"]])
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert row["generated_ids"] == ref
    assert len(row["logprobs"]) == 8 and all(lp <= 0 for lp in row["logprobs"])
