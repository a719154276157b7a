"""``mg generate --stop-token``: a prompt stops right after the first generated occurrence of the token, and a
text that is not one token is a one-line error."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from click.testing import CliRunner

import mg_data
from mg_cli.main import cli
from mg_data.tokenizers import ByteTokenizer


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random GPT-2 over the byte vocabulary (259 ids: bytes, then eod 256)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=259, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=256, eos_token_id=256))
    d = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(d)
    return d


@pytest.fixture(autouse=True)
def byte_tokenizer(monkeypatch):
    monkeypatch.setattr(mg_data, "build_tokenizer", lambda *args, **kwargs: ByteTokenizer())


def _generate(hf_dir, *args: str) -> list[int]:
    result = CliRunner().invoke(cli, ["generate", "--checkpoint", str(hf_dir), "--tokenizer-model", "bytes",
                                      "--prompt", "def f(x):", "--max-new-tokens", "24", "--no-stop-at-eod",
                                      "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)[0]["generated_ids"]


def test_stops_after_the_first_stop_token(hf_dir):
    free = _generate(hf_dir)
    assert len(free) == 24
    # a token of the free run after its first step that is one ASCII character as text
    stop = next(t for t in free[1:] if 32 <= t < 127)
    expected = free[:free.index(stop) + 1]
    assert len(expected) < len(free)
    assert _generate(hf_dir, "--stop-token", chr(stop)) == expected
    # several: a row stops at whichever comes first (here one that never appears, then the one above)
    unused = next(chr(t) for t in range(33, 127) if t not in free)
    assert _generate(hf_dir, "--stop-token", unused, "--stop-token", chr(stop)) == expected


def test_a_text_of_several_tokens_is_refused(hf_dir):
    result = CliRunner().invoke(cli, ["generate", "--checkpoint", str(hf_dir), "--tokenizer-model", "bytes",
                                      "--prompt", "x", "--stop-token", "<|im_end|>"])
    assert result.exit_code == 1
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("Error: --stop-token '<|im_end|>' encodes to 10 tokens"), line
    assert "not one" in line
