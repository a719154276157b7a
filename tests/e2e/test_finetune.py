"""Fine-tuning with `mg train`: checkpoint.init_from (an mg checkpoint of another layout, a Hugging Face directory),
the sft, classification and seq2seq formats at tp/pp/dp layouts against one process (loss and grad_norm at every
iteration, effective settings reported), bit-exact resume, and export to the matching Hugging Face class."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from tests.e2e.conftest import (
    BASE_SETTINGS,
    assert_reports_settings,
    assert_same_training,
    family_args,
    iteration_records,
    mg,
    tiny_args,
)

FT = ["train.iters=6", "optim.warmup_iters=1", "eval.iters=1", "model.preset=null"]
"""Fine-tuning runs: 6 iterations, the architecture from checkpoint.init_from."""

ADD = "You add numbers."


def _conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(1, 60), rng.randint(1, 60)
        if i % 3:
            out.append({"messages": [{"role": "system", "content": ADD}, {"role": "user", "content": f"{a} + {b}?"},
                                     {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]})
        else:
            out.append({"prompt": f"Repeat {a}.", "completion": f"{a} {a}"})
    return out


def _labelled(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = {"pos": "good great fine nice happy warm", "neg": "bad awful sad poor ugly cold", "mid": "so so okay"}
    out = []
    for _ in range(n):
        label = rng.choice(sorted(words))
        out.append({"text": " ".join(rng.choice(words[label].split()) for _ in range(rng.randint(2, 6))),
                    "label": label})
    return out


def _pairs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"input": f"print {a}", "target": f"print({a})"} for a in (rng.randint(0, 999) for _ in range(n))]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tasks(corpus, tmp_path_factory) -> dict[str, Path]:
    """Task data: preprocessed conversations and labelled texts (the corpus tokenizer), seq2seq pairs as JSONL."""
    root = tmp_path_factory.mktemp("finetune")
    tok = str(corpus["tokenizer"])
    mg("preprocess", "--format", "sft", "--input", str(_write(root / "chats.jsonl", _conversations(240, 1))),
       "--tokenizer-model", tok, "--output-prefix", str(root / "chats"), "--seq-length", "64", "--on-long", "drop")
    mg("preprocess", "--format", "classification", "--input", str(_write(root / "labels.jsonl", _labelled(240, 2))),
       "--tokenizer-model", tok, "--output-prefix", str(root / "labels"))
    return {"root": root, "chats": root / "chats", "labels": root / "labels",
            "pairs": _write(root / "pairs.jsonl", _pairs(240, 3))}


@pytest.fixture(scope="module")
def pretrained(layout_runs) -> Path:
    """A GPT pretrained at tp2 (20 iterations; the same run the layout tests use)."""
    return layout_runs.get(2, ("parallel.tp=2",))[1]


def _finetune(corpus, root: Path, name: str, nproc: int, *sets: str) -> tuple[Path, str]:
    log = root / name
    args = tiny_args(corpus, log, *FT, *sets, f"checkpoint.save={root / (name + '-ckpt')}")
    if nproc > 1:
        args += ["--nproc-per-node", str(nproc)]
    return log, mg(*args).stdout


LAYOUTS = {  # name: (processes, --set values, effective settings besides BASE_SETTINGS)
    "tp2-sp": (2, ("parallel.tp=2", "parallel.sequence_parallel=true"),
               {"tp": 2, "sequence_parallel": True}),
    "pp2-dp2-do": (4, ("parallel.pp=2", "parallel.use_distributed_optimizer=true"),
                   {"pp": 2, "dp": 2, "distributed_optimizer": True, "micro_batches": 2, "schedule": "1f1b"}),
    "tp2-dp2-do": (4, ("parallel.tp=2", "parallel.use_distributed_optimizer=true"),
                   {"tp": 2, "dp": 2, "distributed_optimizer": True, "micro_batches": 2}),
    "pp2": (2, ("parallel.pp=2",), {"pp": 2, "schedule": "1f1b"}),
    "cp2": (2, ("parallel.cp=2",), {"cp": 2, "cp_comm": "p2p"}),
}


def _assert_resumes_exactly(args: list[str], ref: dict[int, dict], log: Path) -> None:
    """``mg train args`` (a resume from iteration 3 of the reference) gives iterations 4..6 bit for bit."""
    mg(*args)
    again = iteration_records(log)
    assert sorted(again) == [4, 5, 6]
    for it in (4, 5, 6):
        assert (again[it]["loss"], again[it]["grad_norm"]) == (ref[it]["loss"], ref[it]["grad_norm"]), it


def _assert_layouts_and_resume(corpus, root: Path, sets: list[str], ref: dict[int, dict], layouts: tuple[str, ...],
                               what: str) -> None:
    """Each of ``layouts`` reports its settings and trains as the one-process ``ref`` (``root/ref-ckpt``, saved at
    iteration 3); a resume from iteration 3 at one process is bit-exact."""
    for name in layouts:
        nproc, layout_sets, settings = LAYOUTS[name]
        log, out = _finetune(corpus, root, name, nproc, *sets, *layout_sets)
        assert_reports_settings(log, out, nproc, {**BASE_SETTINGS, **settings})
        assert_same_training(iteration_records(log), ref, f"{what} {name}")
    resumed = root / "resumed"
    _assert_resumes_exactly(
        tiny_args(corpus, resumed, *FT, *sets, f"checkpoint.load={root / 'ref-ckpt' / 'iter_0000003'}"), ref, resumed)


def test_sft_from_a_checkpoint_of_another_layout(corpus, tasks, pretrained, tmp_path):
    """SFT of the tp2-pretrained GPT: one process, tp2 with sequence parallelism, pp2 x dp2 with the distributed
    optimizer and cp2 (packed conversations split over two ranks) agree at every iteration; a resume from
    iteration 3 continues bit-exactly; a Hugging Face export of the pretrained model gives the same first step as
    the mg checkpoint."""
    sft = ["data.format=sft", f"data.path={tasks['chats']}", f"checkpoint.init_from={pretrained}",
           "model.seq_length=64", "checkpoint.interval=3"]
    ref_log, out = _finetune(corpus, tmp_path, "ref", 1, *sft)
    assert f"init_from {pretrained}: loaded 52 of 52 tensors; initialised (not in the pretrained model): none; " \
           "dropped (unused by this model): none" in out, out[-3000:]
    ref = iteration_records(ref_log)
    assert ref[6]["loss"] < ref[1]["loss"]
    _assert_layouts_and_resume(corpus, tmp_path, sft, ref, ("tp2-sp", "pp2-dp2-do", "cp2"), "sft")

    hf = tmp_path / "pretrained-hf"
    mg("convert", "--to", "hf", "--input", str(pretrained), "--output", str(hf))
    from_hf, _ = _finetune(corpus, tmp_path, "from-hf", 1, *[s for s in sft if "init_from" not in s],
                           f"checkpoint.init_from={hf}", "train.iters=1", "optim.decay_iters=6")
    assert iteration_records(from_hf)[1]["loss"] == pytest.approx(ref[1]["loss"], rel=1e-6)
    assert iteration_records(from_hf)[1]["grad_norm"] == pytest.approx(ref[1]["grad_norm"], rel=1e-6)


def test_gpt_classification_layouts_and_export(corpus, tasks, pretrained, tmp_path):
    """A classification head on the pretrained GPT (initialised, the rest loaded): tp2 x dp2 with the distributed
    optimizer and pp2 agree with one process; the checkpoint exports to GPT2ForSequenceClassification with its
    labels, and transformers' logits equal mg's."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from mg_data import build_tokenizer
    from mg_models import load_pretrained

    cls = ["data.format=classification", f"data.path={tasks['labels']}", f"checkpoint.init_from={pretrained}",
           "model.seq_length=32", "checkpoint.interval=3"]
    ref_log, out = _finetune(corpus, tmp_path, "ref", 1, *cls)
    assert "initialised (not in the pretrained model): score.weight;" in out, out[-3000:]
    ref = iteration_records(ref_log)
    _assert_layouts_and_resume(corpus, tmp_path, cls, ref, ("tp2-dp2-do", "pp2"), "classification")

    hf_dir = tmp_path / "hf"
    mg("convert", "--to", "hf", "--input", str(tmp_path / "ref-ckpt"), "--output", str(hf_dir))
    hf, info = AutoModelForSequenceClassification.from_pretrained(hf_dir, output_loading_info=True)
    assert not any(info.values()), info
    assert type(hf).__name__ == "GPT2ForSequenceClassification"
    assert hf.config.id2label == {0: "mid", 1: "neg", 2: "pos"}
    tok = build_tokenizer(str(corpus["tokenizer"]))
    ids = [tok.encode("good great day"), tok.encode("bad sad ugly cold and awful")]
    width, pad = max(map(len, ids)), hf.config.pad_token_id
    x = torch.tensor([i + [pad] * (width - len(i)) for i in ids])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    with torch.no_grad():
        expected = hf(input_ids=x, attention_mask=mask).logits
        got = load_pretrained(tmp_path / "ref-ckpt")(x, attention_mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bert_classification_layout_and_export(bert_t5_corpus, tmp_path):
    """BERT with a classification head over [CLS] (from a .jsonl, string labels): tp2 with sequence parallelism,
    and pp2 x dp2 with the distributed optimizer, agree with one process; the export is a
    BertForSequenceClassification whose logits equal mg's."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from mg_data import build_tokenizer
    from mg_models import load_pretrained

    data = _write(tmp_path / "labels.jsonl", _labelled(240, 4))
    base = ["data.format=classification", f"data.path={data}", "model.seq_length=32", "data.on_long=truncate",
            "data.split=90,10,0", f"checkpoint.save={tmp_path / 'ref-ckpt'}"]
    ref_log = tmp_path / "ref"
    mg(*family_args(bert_t5_corpus, "bert", ref_log, *base, iters=6))
    ref = iteration_records(ref_log)
    for layout in ("tp2-sp", "pp2-dp2-do"):
        nproc, sets, settings = LAYOUTS[layout]
        log = tmp_path / layout
        out = mg(*family_args(bert_t5_corpus, "bert", log, *base[:-1], *sets, iters=6),
                 "--nproc-per-node", str(nproc)).stdout
        assert_reports_settings(log, out, nproc, {**BASE_SETTINGS, **settings})
        assert_same_training(iteration_records(log), ref, f"bert classification {layout}")

    hf_dir = tmp_path / "hf"
    mg("convert", "--to", "hf", "--input", str(tmp_path / "ref-ckpt"), "--output", str(hf_dir))
    hf, info = AutoModelForSequenceClassification.from_pretrained(hf_dir, output_loading_info=True)
    assert not any(info.values()), info
    assert type(hf).__name__ == "BertForSequenceClassification" and hf.config.id2label[2] == "pos"
    tok = build_tokenizer(str(bert_t5_corpus["tokenizer"]))
    cls_id, sep_id = (tok.sp.piece_to_id(p) for p in ("<cls>", "<sep>"))
    x = torch.tensor([[cls_id, *tok.encode("good happy warm"), sep_id]])
    with torch.no_grad():
        expected = hf.eval()(input_ids=x).logits
        got = load_pretrained(tmp_path / "ref-ckpt")(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_t5_seq2seq_from_jsonl(bert_t5_corpus, tmp_path):
    """T5 on {input, target} pairs read from a .jsonl file: tp2 x dp2 and pp2 x dp2 with the distributed optimizer
    agree with one process, a resume is bit-exact, and the pp2 x dp2 checkpoint resumes at one process; the export's T5ForConditionalGeneration loss on a batch equals mg's (1e-6);
    a key of another format is a one-line error."""
    import numpy as np
    import torch
    from transformers import T5ForConditionalGeneration

    from mg_data import Seq2SeqDatasetConfig, build_seq2seq_datasets, build_tokenizer
    from mg_models import load_pretrained

    pairs = _write(tmp_path / "pairs.jsonl", _pairs(240, 3))
    base = ["data.format=seq2seq", f"data.path={pairs}", "model.seq_length=12", "model.decoder_seq_length=12",
            "data.split=90,10,0"]
    ref_log = tmp_path / "ref"
    mg(*family_args(bert_t5_corpus, "t5", ref_log, *base, f"checkpoint.save={tmp_path / 'ref-ckpt'}",
                    "checkpoint.interval=3", iters=6))
    ref = iteration_records(ref_log)
    assert ref[6]["loss"] < ref[1]["loss"]
    for name in ("tp2-dp2-do", "pp2-dp2-do"):
        nproc, sets, settings = LAYOUTS[name]
        log = tmp_path / name
        out = mg(*family_args(bert_t5_corpus, "t5", log, *base, *sets, f"checkpoint.save={tmp_path / name}-ckpt",
                              "checkpoint.interval=3", iters=6), "--nproc-per-node", str(nproc)).stdout
        assert_reports_settings(log, out, nproc, {**BASE_SETTINGS, **settings})
        assert_same_training(iteration_records(log), ref, f"seq2seq {name}")
    resumed = tmp_path / "resumed"
    _assert_resumes_exactly(family_args(bert_t5_corpus, "t5", resumed, *base, "checkpoint.load="
                                        f"{tmp_path / 'ref-ckpt' / 'iter_0000003'}", iters=6), ref, resumed)
    # The pipeline's checkpoint (each tensor saved once: the tables by the first stage, the tied head not at all)
    # resumes at one process.
    from_pp = tmp_path / "from-pp2"
    mg(*family_args(bert_t5_corpus, "t5", from_pp, *base,
                    f"checkpoint.load={tmp_path / 'pp2-dp2-do-ckpt' / 'iter_0000003'}", iters=6))
    again = iteration_records(from_pp)
    assert sorted(again) == [4, 5, 6]
    assert_same_training(again, {it: ref[it] for it in (4, 5, 6)}, "seq2seq resumed at pp1 from pp2-dp2-do")

    hf_dir = tmp_path / "hf"
    mg("convert", "--to", "hf", "--input", str(tmp_path / "ref-ckpt"), "--output", str(hf_dir))
    hf = T5ForConditionalGeneration.from_pretrained(hf_dir).eval()
    tok = build_tokenizer(str(bert_t5_corpus["tokenizer"]))
    pad = tok.sp.piece_to_id("<pad>")
    from mg_ckpt import CheckpointReader

    assert CheckpointReader(tmp_path / "ref-ckpt" / "iter_0000006", verify=False).extra["decoder_start_token_id"] == pad
    ds, _, _ = build_seq2seq_datasets(Seq2SeqDatasetConfig(encoder_seq_length=12, decoder_seq_length=12,
                                                           eos_id=tok.eod, pad_id=pad), [str(pairs)], tokenizer=tok)
    batch = {k: torch.from_numpy(np.stack([ds[i][k] for i in range(4)])) for k in ds[0]}
    with torch.no_grad():
        expected = hf(input_ids=batch["text_enc"], attention_mask=batch["enc_mask"],
                      decoder_input_ids=batch["text_dec"], labels=batch["labels"]).loss
        per_token, _ = load_pretrained(tmp_path / "ref-ckpt")(batch["text_enc"], batch["text_dec"], batch["enc_mask"],
                                                              labels=batch["labels"])
    mask = batch["loss_mask"]
    assert (per_token * mask).sum() / mask.sum() == pytest.approx(expected.item(), rel=1e-6)

    from click.testing import CliRunner

    from mg_cli.main import cli

    result = CliRunner().invoke(cli, family_args(bert_t5_corpus, "t5", tmp_path / "bad", *base, "data.packing=none"))
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        "Error: data.packing is not used by T5 with data.format=seq2seq (model.type=t5); it is only used by "
        "model.type=gpt with data.format=sft; leave it unset")
    shutil.rmtree(tmp_path / "bad", ignore_errors=True)
