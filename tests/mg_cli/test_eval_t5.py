"""T5 in `mg eval`: generation starts the decoder from the checkpoint's own start id (a Hugging Face
``config.json``'s ``decoder_start_token_id``, or the id mg training records), and seq2seq outputs equal
``transformers``' greedy ``generate`` on the same weights."""

from __future__ import annotations

import json

import torch
import transformers

from mg_cli.evaluation.evaluate import Evaluator
from mg_cli.evaluation.layouts import build_runner
from mg_cli.evaluation.lm import LMScorer
from mg_cli.evaluation.options import EvalOptions
from mg_cli.evaluation.runner import decoder_start_token_id
from mg_cli.evaluation.tasks import parse_task
from mg_data.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
START = 258  # not T5's usual 0, so a decoder started from 0 gives other outputs


def test_t5_seq2seq_outputs_equal_transformers_from_its_start_id(tmp_path):
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=259, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=START, pad_token_id=START, eos_token_id=TOK.eod)).eval()
    hf.save_pretrained(tmp_path / "t5")
    runner, extra, _ = build_runner(tmp_path / "t5")
    assert runner.decoder_start_token_id == START
    rows = [{"input": "abc", "target": "def"}, {"input": "hello there", "target": ["x", "y"]}]
    task = tmp_path / "s.jsonl"
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = Evaluator(LMScorer(runner, TOK), EvalOptions(max_new_tokens=6)).run(parse_task(f"seq2seq:{task}"))
    expected = []
    for r in rows:
        out = hf.generate(torch.tensor([list(r["input"].encode())]), max_new_tokens=6, do_sample=False)[0, 1:]
        expected.append(TOK.decode([t for t in out.tolist() if t not in (TOK.eod, START)]).strip())
    assert res["outputs"] == expected
    # the ids mg's checkpoints record come first; a directory without any gives T5's 0
    assert decoder_start_token_id(tmp_path / "t5", {"decoder_start_token_id": 7}) == 7
    assert decoder_start_token_id(tmp_path, {}) == 0
