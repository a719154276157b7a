"""``mg_models.load_pretrained(<mg checkpoint>)`` from plain Python: a fresh interpreter that imports only
mg_models opens checkpoints written by ``mg train`` at tp=2 and by ``mg convert --from hf --tp 2`` (GPT, BERT,
T5), mg checkpoints read by mg-models itself (no mg-cli import), and its fp32 logits
equal Hugging Face's to 1e-5.

One ``mg train`` per family (2 iterations), conversions in this process, and one child interpreter for all
six checkpoints keep the process count low.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch
import transformers

from tests.e2e.conftest import family_args, mg, tiny_args

TOL = 1e-5
FAMILIES = ("gpt", "bert", "t5")

# Runs in a fresh interpreter: nothing but mg_models is imported, and nothing is registered by hand.
CHILD = """
import json, sys
import torch
import mg_models
assert "mg_cli" not in sys.modules, "importing mg_models must not import mg_cli"
job = json.loads(sys.argv[1])
inputs = torch.load(job["inputs"])
out = {}
with torch.no_grad():
    for name, (path, family) in job["checkpoints"].items():
        model = mg_models.load_pretrained(path)
        x = inputs[name]
        if family == "gpt":
            out[name] = {"logits": model(x["ids"])}
        elif family == "bert":
            logits, binary = model(x["ids"], token_type_ids=x["types"], attention_mask=x["mask"])
            out[name] = {"logits": logits, "binary": binary}
        else:
            logits, _ = model(x["ids"], decoder_input_ids=x["dec"], attention_mask=x["mask"])
            out[name] = {"logits": logits}
        out[name]["class"] = type(model).__name__
out["mg_cli_imported"] = "mg_cli" in sys.modules
torch.save(out, job["output"])
"""


def _convert(*args: str) -> None:
    """``mg convert ARGS`` in this process (it starts no workers)."""
    from click.testing import CliRunner

    from mg_cli.main import cli

    result = CliRunner().invoke(cli, ["convert", *args])
    assert result.exit_code == 0, (result.output, result.exception)


def _perturb(model: torch.nn.Module) -> torch.nn.Module:
    # Hugging Face starts norms at 1 and biases at 0; move them so each mapping is tested.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((0.1 if p.ndim == 1 else 0.02) * torch.randn(p.shape, generator=gen))
    return model.eval()


def _hf_model(family: str) -> torch.nn.Module:
    """A tiny randomly initialised Hugging Face model per family: Llama (GQA, untied), BERT with its
    pre-training heads, T5 v1.1 (gated-GeLU, untied head)."""
    torch.manual_seed(0)
    if family == "gpt":
        cfg = transformers.LlamaConfig(vocab_size=301, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       tie_word_embeddings=False)
        return _perturb(transformers.LlamaForCausalLM(cfg))
    if family == "bert":
        cfg = transformers.BertConfig(vocab_size=301, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=96, max_position_embeddings=64)
        return _perturb(transformers.BertForPreTraining(cfg))
    cfg = transformers.T5Config(vocab_size=301, d_model=48, d_kv=12, d_ff=96, num_layers=2, num_decoder_layers=1,
                                num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    return _perturb(transformers.T5ForConditionalGeneration(cfg))


def _inputs(vocab: int, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # padding in the second row
    return {
        "gpt": {"ids": torch.randint(0, vocab, (2, 16), generator=gen)},
        "bert": {"ids": torch.randint(0, vocab, (2, 12), generator=gen),
                 "types": torch.randint(0, 2, (2, 12), generator=gen), "mask": mask},
        "t5": {"ids": torch.randint(0, vocab, (2, 12), generator=gen),
               "dec": torch.randint(0, vocab, (2, 7), generator=gen), "mask": mask},
    }


def _hf_outputs(model: torch.nn.Module, family: str, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        if family == "gpt":
            return {"logits": model(x["ids"]).logits}
        if family == "bert":
            out = model(x["ids"], token_type_ids=x["types"], attention_mask=x["mask"])
            return {"logits": out.prediction_logits, "binary": out.seq_relationship_logits}
        return {"logits": model(input_ids=x["ids"], attention_mask=x["mask"], decoder_input_ids=x["dec"]).logits}


def _hf_from_export(family: str, path) -> torch.nn.Module:
    auto = {"gpt": transformers.AutoModelForCausalLM, "bert": transformers.AutoModelForPreTraining,
            "t5": transformers.AutoModelForSeq2SeqLM}[family]
    return auto.from_pretrained(path).eval()


def test_plain_python_loads_trained_and_converted_checkpoints(bert_t5_corpus, tmp_path):
    # (a) mg train at tp=2 (2 iterations) writes a checkpoint; mg convert --to hf gives the reference.
    # GPT trains on the same corpus's documents, so the test builds one corpus, not two.
    gpt_corpus = {"prefix": bert_t5_corpus["documents"], "tokenizer": bert_t5_corpus["tokenizer"]}
    checkpoints, references = {}, {}
    for family in FAMILIES:
        save = tmp_path / f"{family}-trained"
        sets = ["parallel.tp=2", f"checkpoint.save={save}"]
        if family == "gpt":
            args = tiny_args(gpt_corpus, tmp_path / f"{family}-log", *sets, iters=2)
        else:
            args = family_args(bert_t5_corpus, family, tmp_path / f"{family}-log", *sets, iters=2)
        out = mg(*args, "--nproc-per-node", "2").stdout
        assert "tp=2 pp=1 dp=1" in out, out[-2000:]
        _convert("--to", "hf", "--input", str(save), "--output", str(tmp_path / f"{family}-trained-hf"))
        checkpoints[f"{family}-trained"] = (str(save), family)  # the save directory: its `latest` is followed
        references[f"{family}-trained"] = _hf_from_export(family, tmp_path / f"{family}-trained-hf")
    # (b) mg convert --from hf --tp 2 of a random, perturbed Hugging Face model; the reference is that model.
    for family in FAMILIES:
        hf = _hf_model(family)
        hf.save_pretrained(tmp_path / f"{family}-hf", safe_serialization=True)
        _convert("--from", "hf", "--input", str(tmp_path / f"{family}-hf"), "--output",
                 str(tmp_path / f"{family}-converted"), "--tp", "2")
        checkpoints[f"{family}-converted"] = (str(tmp_path / f"{family}-converted"), family)
        references[f"{family}-converted"] = hf

    inputs = {"trained": _inputs(512, 2), "converted": _inputs(301, 3)}  # the two vocabularies
    per_checkpoint = {name: inputs[name.split("-")[1]][family] for name, (_, family) in checkpoints.items()}
    torch.save(per_checkpoint, tmp_path / "inputs.pt")
    job = {"checkpoints": checkpoints, "inputs": str(tmp_path / "inputs.pt"), "output": str(tmp_path / "out.pt")}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = torch.load(tmp_path / "out.pt")
    assert not results.pop("mg_cli_imported"), "plain mg_models needed mg-cli to read the mg checkpoints"
    expected_class = {"gpt": "GPTModel", "bert": "BertModel", "t5": "T5Model"}
    for name, (_, family) in checkpoints.items():
        ours = results[name]
        assert ours.pop("class") == expected_class[family], name
        ref = _hf_outputs(references[name], family, per_checkpoint[name])
        assert sorted(ours) == sorted(ref), name
        for key, value in ref.items():
            assert ours[key].shape == value.shape, (name, key)
            diff = (ours[key] - value).abs().max().item()
            assert diff <= TOL, f"{name} {key}: max |mg - Hugging Face| = {diff:.3g}"
