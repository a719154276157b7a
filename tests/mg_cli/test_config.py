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


def test_override_does_not_drop_a_malformed_section(tmp_path):
    """`train: 5` is an error naming the section, also when --set touches it (it was silently replaced)."""
    bad = tmp_path / "section.yaml"
    bad.write_text("train: 5\n")
    with pytest.raises(ConfigError, match=r"section 'train' must be a mapping"):
        load_config(bad, ["train.iters=3"])
    with pytest.raises(ConfigError, match=r"section 'train' must be a mapping"):
        load_config(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("train:\n")  # an empty section is fine
    assert load_config(empty, ["train.iters=3"]).train.iters == 3


def test_model_family_keys():
    keys = set(all_keys())
    assert {"model.kv_channels", "model.num_decoder_layers", "model.decoder_seq_length", "data.sentence_task"} <= keys
    cfg = load_config(None, ["model.type=t5", "model.activation=gated-gelu", "model.decoder_seq_length=30",
                             "model.num_decoder_layers=3"])
    assert cfg.model.activation == "gated-gelu" and cfg.model.decoder_seq_length == 30
    assert from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match=r"data.sentence_task='order' is not one of 'sop', 'nsp', 'none'"):
        load_config(None, ["data.sentence_task=order"])
    with pytest.raises(ConfigError, match=r"model.decoder_seq_length must be >= 1, got 0"):
        load_config(None, ["model.decoder_seq_length=0"])


def test_family_model_configs_from_presets_and_keys():
    """Reference: mg_models' own preset tables, with the config's explicit keys and the tokenizer's vocabulary."""
    from mg_cli.training import TrainingError
    from mg_cli.training.build import model_config
    from mg_models.bert import BERT_PRESETS, BertConfig
    from mg_models.t5 import T5_PRESETS, T5Config

    bert = model_config(load_config(None, ["model.type=bert", "model.preset=tiny-bert", "model.num_layers=3",
                                           "model.seq_length=200", "data.sentence_task=none"]), 300)
    assert type(bert) is BertConfig
    assert bert == BertConfig(**{**BERT_PRESETS["tiny-bert"], "num_layers": 3, "vocab_size": 300,
                                 "max_position_embeddings": 200, "add_binary_head": False})
    t5 = model_config(load_config(None, ["model.type=t5", "model.preset=t5-v1_1-small", "model.num_decoder_layers=2",
                                         "model.dropout=0.1"]), 300)
    assert type(t5) is T5Config
    assert t5 == T5Config(**{**T5_PRESETS["t5-v1_1-small"], "num_decoder_layers": 2, "vocab_size": 300,
                             "dropout": 0.1})
    shape = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4"]
    t5 = model_config(load_config(None, ["model.type=t5", *shape]), 300)
    assert (t5.kv_channels, t5.ffn_hidden_size, t5.activation) == (8, 128, "relu")
    with pytest.raises(TrainingError, match=r"model.preset='gpt2-small' is not a BERT preset"):
        model_config(load_config(None, ["model.type=bert", "model.preset=gpt2-small"]), 300)
    with pytest.raises(TrainingError, match=r"model.position_embedding is not used by T5"):
        model_config(load_config(None, ["model.type=t5", "model.position_embedding=rope", *shape]), 300)
    with pytest.raises(TrainingError, match=r"model.activation='swiglu': BERT supports"):
        model_config(load_config(None, ["model.type=bert", "model.activation=swiglu", *shape]), 300)
    with pytest.raises(TrainingError, match=r"model.activation=relu is a T5 activation"):
        model_config(load_config(None, ["model.activation=relu", *shape]), 300)


# ----------------------------------------------------------------------------------- one config universe


def test_sections_are_the_library_dataclasses():
    """Every init field of the library config classes is a key of its section, under the same name."""
    import dataclasses

    from mg_data import BertDatasetConfig, GPTDatasetConfig, T5DatasetConfig
    from mg_models import GPTConfig
    from mg_models.bert import BertConfig
    from mg_models.t5 import T5Config
    from mg_parallel import ParallelDims
    from mg_parallel.optimizer import OptimizerConfig
    from mg_parallel.recompute import RecomputeConfig

    keys = set(all_keys())
    run_filled = {"vocab_size", "add_binary_head", "world_size", "seed", "cache_dir", "eod_id", "seq_length",
                  "max_seq_length", "encoder_seq_length", "decoder_seq_length", "cls_id", "sep_id", "mask_id",
                  "pad_id", "sentinel_ids", "eos_id", "decoder_start_id", "is_word_start", "word_starts",
                  "reset_attention_mask", "create_attention_mask"}
    expected = {"model": (GPTConfig, BertConfig, T5Config), "parallel": (ParallelDims,),
                "data": (GPTDatasetConfig, BertDatasetConfig, T5DatasetConfig)}
    for section, classes in expected.items():
        for cls in classes:
            names = {f.name for f in dataclasses.fields(cls) if f.init} - run_filled
            assert {n for n in names if f"{section}.{n}" not in keys} == set(), cls.__name__
    optimizer = {f.name for f in dataclasses.fields(OptimizerConfig)}
    spread = {k.split(".")[1] for k in keys if k.split(".")[0] in ("optim", "train", "parallel")}
    assert optimizer <= spread
    assert {"parallel.recompute_" + f.name for f in dataclasses.fields(RecomputeConfig)} <= keys


def test_a_field_added_to_a_library_dataclass_is_a_key(tmp_path):
    """A subclass of GPTConfig with one more field: --list-keys shows it with its docstring, YAML sets it, and
    the model config mg train builds carries it (nothing in mg-cli edited)."""
    from dataclasses import dataclass

    from mg_cli.config import describe
    from mg_cli.sections import SCHEMA
    from mg_cli.training.build import model_config
    from mg_models import GPTConfig

    @dataclass(kw_only=True)
    class WiderGPTConfig(GPTConfig):
        logit_softcap: float | None = None
        """Cap logits at this magnitude with tanh (None: no cap)."""

    schema = SCHEMA.replace(GPTConfig, WiderGPTConfig)
    listing = describe(schema)
    assert "  logit_softcap: None  # float or null [gpt]; Cap logits at this magnitude with tanh (None: no cap)." \
        in listing.splitlines()
    assert "logit_softcap" not in describe()
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: tiny-gpt2\n  logit_softcap: 30\n")
    cfg = load_config(path, schema=schema)
    assert cfg.model.logit_softcap == 30.0
    built = model_config(cfg, 300)
    assert type(built) is WiderGPTConfig and built.logit_softcap == 30.0
    with pytest.raises(ConfigError, match=r"unknown key 'model.logit_softcap'"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"model.logit_softcap='big' has the wrong type; expected float or null"):
        load_config(None, ["model.logit_softcap=big"], schema=schema)


def test_renamed_keys_still_work_with_a_note():
    cfg = load_config(None, ["model.bias=false", "model.init_std=0.01", "model.tie_embeddings=false",
                             "parallel.distributed_optimizer=true", "parallel.recompute=none"])
    assert (cfg.model.add_bias_linear, cfg.model.init_method_std, cfg.model.tie_word_embeddings) == (False, 0.01, False)
    assert cfg.parallel.use_distributed_optimizer is True and cfg.parallel.recompute_granularity is None
    assert cfg.notes == (
        "config: model.bias is now model.add_bias_linear (the old name still works)",
        "config: model.init_std is now model.init_method_std (the old name still works)",
        "config: model.tie_embeddings is now model.tie_word_embeddings (the old name still works)",
        "config: parallel.distributed_optimizer is now parallel.use_distributed_optimizer (the old name still works)",
        "config: parallel.recompute is now parallel.recompute_granularity (the old name still works)",
    )
    assert load_config(None, ["parallel.recompute=full"]).parallel.recompute_granularity == "full"
    assert "recompute_granularity: full" in load_config(None, ["parallel.recompute=full"]).to_yaml()
    assert load_config(None, ["model.add_bias_linear=false"]).notes == ()
    with pytest.raises(ConfigError, match=r"both model.bias and model.add_bias_linear are set"):
        load_config(None, ["model.bias=false", "model.add_bias_linear=true"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.adam_beta2=1.5", r"optimizer.adam_beta2 must be in \[0, 1\)"),  # OptimizerConfig's own check
        ("parallel.recompute_num_layers=2", r"recompute.num_layers only applies to granularity='full'"),
        ("parallel.overlap_param_gather=true", r"overlap_param_gather needs optimizer.use_distributed_optimizer"),
        ("parallel.tp=0", r"parallel.tp must be a positive integer, got 0"),
        ("log.interval=0", r"log.interval must be >= 1, got 0"),
        ("checkpoint.interval=-1", r"checkpoint.interval must be >= 0, got -1"),
        ("parallel.recompute_granularity=none", r"parallel.recompute_granularity='none' has the wrong type"),
    ],
)
def test_each_constraint_is_the_owning_dataclass(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_a_key_of_another_family_is_an_error():
    from mg_cli.training import TrainingError
    from mg_cli.training.build import model_config
    from mg_cli.training.data import dataset_config

    with pytest.raises(TrainingError, match=r"data.masked_lm_prob is not used by GPT \(model.type=gpt\); it is only "
                                            r"used by model.type=bert"):
        dataset_config(load_config(None, ["data.masked_lm_prob=0.2"]), None, None)
    with pytest.raises(TrainingError, match=r"model.num_decoder_layers is not used by GPT"):
        model_config(load_config(None, ["model.preset=tiny-gpt2", "model.num_decoder_layers=2"]), 300)
    gpt = model_config(load_config(None, ["model.preset=tiny-gpt2", "model.dropout=0.1",
                                          "model.hidden_dropout=0.2"]), 300)
    assert (gpt.attention_dropout, gpt.hidden_dropout) == (0.1, 0.2)  # model.dropout sets what is not given


def test_list_keys_shows_every_key_with_its_docstring():
    from mg_cli.config import describe

    listing = describe()
    for key in all_keys():
        section, name = key.split(".")
        assert f"  {name}: " in listing or f"#   {key} -> " in listing, key
    assert "  add_bias_linear: None  # bool or null [gpt/bert]; Biases on the attention and MLP linear layers." \
        in listing.splitlines()
    assert "  tp: 1  # int; Tensor-parallel size: each layer's weights are split over this many ranks." \
        in listing.splitlines()


def test_a_mapping_key_takes_a_yaml_mapping(tmp_path):
    """model.rotary_scaling (a dict field of GPTConfig) is written as a YAML mapping and checked by GPTConfig."""
    from mg_cli.training import TrainingError
    from mg_cli.training.build import model_config

    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: tiny-llama\n  rotary_scaling: {type: llama3, factor: 8, low_freq_factor: 1,\n"
                    "    high_freq_factor: 4, original_max_position_embeddings: 64}\n")
    gpt = model_config(load_config(path), 300)
    assert gpt.rotary_scaling == {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 64}
    with pytest.raises(ConfigError, match=r"model.rotary_scaling=8 has the wrong type; expected dict or null"):
        load_config(None, ["model.rotary_scaling=8"])
    with pytest.raises(TrainingError, match=r"missing model.rotary_scaling.original_max_position_embeddings"):
        model_config(load_config(None, ["model.preset=tiny-llama", "model.rotary_scaling={type: yarn, factor: 4}"]),
                     300)
