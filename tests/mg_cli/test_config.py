"""Run configuration: YAML + --set, type checks, unknown keys with suggestions, round trip."""

import pytest

from mg_cli.config import ConfigError, RunConfig, all_keys, from_dict, load_config

REQUIRED_KEYS = (
    "model.type model.preset model.num_layers model.hidden_size model.num_attention_heads "
    "model.num_query_groups model.ffn_hidden_size model.seq_length model.position_embedding "
    "model.normalization model.activation model.tie_embeddings model.dropout "
    "parallel.tp parallel.pp parallel.vpp parallel.sequence_parallel parallel.distributed_optimizer "
    "parallel.recompute train.micro_batch_size train.global_batch_size train.iters train.seed "
    "train.precision optim.lr optim.min_lr optim.warmup_iters optim.decay_iters optim.decay_style "
    "optim.weight_decay optim.clip_grad optim.adam_beta1 optim.adam_beta2 data.path data.split "
    "data.tokenizer_model data.num_workers eval.interval eval.iters checkpoint.save checkpoint.load "
    "checkpoint.interval checkpoint.async checkpoint.keep_last log.dir log.interval log.tensorboard"
).split()


def test_documented_key_names_exist():
    keys = set(all_keys())
    assert [k for k in REQUIRED_KEYS if k not in keys] == []


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: gpt-tiny\n  seq_length: 64\ntrain:\n  iters: 7\ncheckpoint:\n  async: true\n")
    cfg = load_config(path, ["train.iters=9", "optim.lr=1e-3", "data.path=[0.3, a, 0.7, b]", "parallel.tp=2"])
    assert cfg.model.preset == "gpt-tiny" and cfg.model.seq_length == 64
    assert cfg.train.iters == 9 and cfg.optim.lr == 1e-3 and cfg.parallel.tp == 2
    assert cfg.checkpoint.async_ is True
    assert cfg.data.path == [0.3, "a", 0.7, "b"]


def test_round_trip_through_dict():
    cfg = load_config(None, ["train.precision=bf16", "checkpoint.async=true"])
    again = from_dict(cfg.to_dict())
    assert again == cfg and isinstance(again, RunConfig)


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=1", r"unknown key 'optim.lrr'; did you mean 'optim.lr'\?"),
        ("trian.iters=3", r"unknown section 'trian'; did you mean 'train'\?"),
        ("train.iters=abc", r"train.iters='abc' has the wrong type; expected int"),
        ("train.precision=fp8", r"train.precision='fp8' is not one of 'fp32', 'bf16', 'fp16'"),
        ("parallel.vpp=2", r"parallel.vpp > 1 needs parallel.pp > 1"),
        ("parallel.sequence_parallel=true", r"sequence_parallel needs parallel.tp > 1"),
        ("train.global_batch_size=10", r"global_batch_size=10 is not divisible by train.micro_batch_size=4"),
        ("train.iters", r"expected section.key=value"),
        ("optim.decay_style=exp", r"optim.decay_style='exp' is not one of"),
    ],
)
def test_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  iters: [1,\n")
    with pytest.raises(ConfigError, match=r"bad.yaml line \d+: not valid YAML"):
        load_config(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"top level must be a mapping"):
        load_config(wrong)
