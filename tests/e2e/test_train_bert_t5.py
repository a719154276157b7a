"""`mg train` for BERT and T5 end to end: every layout gives the single-process losses, grad norms and final
parameters and reports its effective settings; resume is bit-exact,
checkpoints record the model family and config, and unsupported setups fail in one line."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import (
    BASE_SETTINGS,
    assert_reports_settings,
    assert_same_parameters,
    assert_same_training,
    family_args,
    iteration_records,
    mg,
    read_checkpoint,
    train_losses,
)

ITERS, SAVED = 10, 5
DISTOPT = {"dp": 2, "micro_batches": 2, "distributed_optimizer": True}
FSDP = {"dp": 2, "micro_batches": 2, "fsdp": True, "fsdp_shard_size": 2, "offload_optimizer": False}
LAYOUTS = {
    # family: {name: (processes, --set overrides, the effective settings the run must report besides BASE_SETTINGS)}
    "bert": {
        "tp2": (2, ["parallel.tp=2"], {"tp": 2}),
        "dp2-distopt": (2, ["parallel.distributed_optimizer=true"], DISTOPT),
        "pp2": (2, ["parallel.pp=2"], {"pp": 2, "schedule": "1f1b"}),
        "recompute": (1, ["parallel.recompute=full"], {"recompute": "full"}),
        "dp2-fsdp": (2, ["parallel.fsdp=true"], FSDP),
    },
    "t5": {
        "tp2": (2, ["parallel.tp=2"], {"tp": 2}),
        "dp2-distopt": (2, ["parallel.distributed_optimizer=true"], DISTOPT),
        "dp2-fsdp": (2, ["parallel.fsdp=true"], FSDP),  # the embedding shared by encoder, decoder and head
        # the encoder on one stage, the decoder on the other: the encoder output travels with the decoder's
        # activations, the position bias tables sit on both, the tied head holds a copy of the embedding
        "pp2": (2, ["parallel.pp=2"], {"pp": 2, "schedule": "1f1b"}),
    },
}


def _reference(family: str, corpus: dict, root) -> dict[int, float]:
    """One process, ITERS iterations, saving after SAVED (the state a run stopped there would hold)."""
    mg(*family_args(corpus, family, root / "log", f"checkpoint.save={root / 'ckpt'}", f"checkpoint.interval={SAVED}",
                    iters=ITERS))
    by_iteration = iteration_records(root / "log")
    records = list(by_iteration.values())
    losses = {r["iteration"]: r["loss"] for r in records}
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert losses[ITERS] < losses[1] - 0.2, f"the tiny {family} did not learn: {losses[1]} -> {losses[ITERS]}"
    # The logged total is the sum of its parts: BERT masked-LM + sentence order, T5 the decoder LM loss.
    parts = ("lm_loss", "sop_loss") if family == "bert" else ("lm_loss",)
    for r in records:
        assert r["loss"] == pytest.approx(sum(r[p] for p in parts), rel=1e-6), r  # fp32 parts
        assert r["mfu"] > 0
    if family == "bert":
        assert all(0.4 < r["sop_loss"] < 1.0 for r in records)  # a 2-way cross entropy, near log 2 early on
    return by_iteration


@pytest.fixture(scope="module")
def bert_reference(bert_t5_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("bert-ref")
    return root, _reference("bert", bert_t5_corpus, root)


@pytest.fixture(scope="module")
def t5_reference(bert_t5_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("t5-ref")
    return root, _reference("t5", bert_t5_corpus, root)


def _layouts() -> list[tuple[str, str]]:
    return [(f, name) for f, layouts in LAYOUTS.items() for name in layouts]


@pytest.mark.parametrize("family, layout", _layouts(), ids=[f"{f}-{n}" for f, n in _layouts()])
def test_layout_matches_single_process(family, layout, bert_t5_corpus, tmp_path, request):
    root, ref = request.getfixturevalue(f"{family}_reference")
    nproc, sets, expected = LAYOUTS[family][layout]
    out = mg(*family_args(bert_t5_corpus, family, tmp_path / "log", *sets, f"checkpoint.save={tmp_path / 'ckpt'}",
                          iters=ITERS), "--nproc-per-node", str(nproc)).stdout
    assert_reports_settings(tmp_path / "log", out, nproc, {**BASE_SETTINGS, **expected})
    assert_same_training(iteration_records(tmp_path / "log"), ref, f"{family} {layout}")
    final = f"iter_{ITERS:07d}"
    assert_same_parameters(read_checkpoint(tmp_path / "ckpt" / final, "model/"),
                           read_checkpoint(root / "ckpt" / final, "model/"), f"{family} {layout}")


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_resume_is_bit_exact_and_checkpoint_records_the_family(family, bert_t5_corpus, tmp_path, request):
    from mg_ckpt import load_checkpoint

    root, ref = request.getfixturevalue(f"{family}_reference")
    ckpt = root / "ckpt" / f"iter_{SAVED:07d}"
    mg(*family_args(bert_t5_corpus, family, tmp_path, f"checkpoint.load={ckpt}", iters=ITERS))
    resumed = train_losses(tmp_path)
    assert sorted(resumed) == list(range(SAVED + 1, ITERS + 1)), "a run resumed from iter_0000005 logs 6.."
    for it in resumed:
        assert resumed[it] == ref[it]["loss"], f"{family} iteration {it}: {resumed[it]!r} != {ref[it]['loss']!r}"
    # The contract `mg convert` / `mg generate` read: the family and a config that round-trips.
    state = load_checkpoint(str(ckpt), {})
    assert state["model_family"] == family
    if family == "bert":
        from mg_models.bert import BertConfig as cls
    else:
        from mg_models.t5 import T5Config as cls
    config = cls.from_dict(state["model_config"])
    assert type(config) is cls and config.to_dict() == state["model_config"]
    assert config.vocab_size == 512 and config.num_layers == 2


def _cli(args: list[str]) -> str:
    """Run `mg` in-process (these checks fail before any worker starts); return its one-line error."""
    from click.testing import CliRunner

    from mg_cli.main import cli

    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("Error: ") and "Traceback" not in result.output, result.output[-3000:]
    return lines[-1]


def test_t5_pipeline_limits_are_one_line_errors(bert_t5_corpus, tmp_path):
    error = _cli(family_args(bert_t5_corpus, "t5", tmp_path, "parallel.pp=2", "parallel.vpp=2")
                 + ["--nproc-per-node", "2"])
    assert error.startswith("Error: parallel.vpp=2: the interleaved pipeline schedule is not supported for "
                            "model.type=t5"), error
    error = _cli(family_args(bert_t5_corpus, "t5", tmp_path, "parallel.pp=3") + ["--nproc-per-node", "3"])
    assert error == ("Error: the 4 encoder and decoder layers (model.num_layers + model.num_decoder_layers) cannot be "
                     "split evenly over parallel.pp*parallel.vpp = 3*1 = 3 pipeline stages; choose a layer count "
                     "divisible by it")


def test_missing_special_tokens_say_how_to_train_a_tokenizer(bert_t5_corpus, tmp_path):
    from mg_data import train_sentencepiece

    plain = train_sentencepiece([str(bert_t5_corpus["jsonl"])], tmp_path / "plain", vocab_size=400,
                                input_sentence_size=5000)
    error = _cli(family_args(bert_t5_corpus, "bert", tmp_path, f"data.tokenizer_model={plain}"))
    assert "has no padding token <pad>, which model.type=bert needs" in error
    assert "mg tokenizer train --input ... --output-prefix ... --user-defined-symbols '<pad>,<cls>,<sep>,<mask>'" in error
    error = _cli(family_args(bert_t5_corpus, "t5", tmp_path, f"data.tokenizer_model={plain}"))
    assert "has no padding token <pad>, which model.type=t5 needs" in error and "--extra-ids 100" in error
    # The test tokenizer holds 16 sentinels; an encoder of 512 tokens needs more.
    error = _cli(family_args(bert_t5_corpus, "t5", tmp_path, "model.seq_length=512"))
    assert "has no sentinel token <extra_id_16> (model.seq_length=512 needs" in error, error


@pytest.mark.parametrize("family, sets, message", [
    ("bert", ["model.preset=tiny-gpt2"],
     "model.preset='tiny-gpt2' is not a BERT preset (model.type=bert); choose one of ['bert-base', 'bert-large', "
     "'tiny-bert']"),
    ("t5", ["model.preset=tiny-bert"], "model.preset='tiny-bert' is not a T5 preset (model.type=t5); choose one of "
                                       "['t5-base', 't5-small', 't5-v1_1-small', 'tiny-t5']"),
    ("t5", ["model.normalization=layernorm"], "model.normalization is not used by T5"),
    ("bert", ["model.decoder_seq_length=20"], "model.decoder_seq_length is only used by model.type=t5"),
])
def test_family_config_errors_are_one_line(bert_t5_corpus, tmp_path, family, sets, message):
    assert message in _cli(family_args(bert_t5_corpus, family, tmp_path, *sets))


def test_bert_on_a_document_dataset_asks_for_sentences(bert_t5_corpus, tmp_path):
    error = _cli(family_args(bert_t5_corpus, "bert", tmp_path, f"data.path={bert_t5_corpus['documents']}"))
    assert "BERT needs a sentence-split dataset" in error and "mg preprocess --split-sentences" in error
