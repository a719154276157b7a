"""Sequence-classification heads: parity with Hugging Face's ``*ForSequenceClassification`` (logits within 1e-5 and
loss within 1e-6, fp32, CPU), exact export round trips, and the same logits, losses and gradients at tp=2 (with and
without sequence parallelism) as in one process.

Randomly initialised Hugging Face models, every tensor perturbed, are the independent reference.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mg_models import GPTConfig, GPTModel, load_pretrained
from mg_models.bert import BertConfig, BertModel
from mg_models.bert.hf import config_from_hf as bert_config_from_hf
from mg_models.bert.hf import read_hf_bert, write_hf_bert
from mg_models.heads import classification_loss
from mg_models.hf import read_hf_directory, write_hf_directory
from mg_parallel.grid import ParallelDims, build_grid
from mg_parallel.testing import run_distributed
from tests.mg_models.test_hf_parity import _check_streaming_groups
from tests.mg_models.test_layout import _full

VOCAB = 301
PAD = 3
B, S = 4, 10


def _perturb(model: torch.nn.Module) -> None:
    # Norms start at 1 and biases at 0; perturb every tensor so each mapping is actually tested.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, S] with pad tokens and the matching mask: rows unpadded, right-padded, left-padded, right-padded."""
    ids = torch.randint(PAD + 1, VOCAB, (B, S), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, :3] = 0
    mask[3, 8:] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def _labels(num_labels: int) -> torch.Tensor:
    if num_labels == 1:
        return torch.randn(B, generator=torch.Generator().manual_seed(4))
    return torch.tensor([num_labels - 1, 0, -100, 1])  # -100: ignored, as in Hugging Face's cross entropy


def _hf_loss_of(loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """mg's per-sample loss reduced as Hugging Face reduces it (mean over the samples whose label counts)."""
    if labels.is_floating_point():
        return loss.mean()
    return loss.sum() / (labels != -100).sum()


def _gpt_family(kind: str, num_labels: int) -> torch.nn.Module:
    common = dict(vocab_size=VOCAB, num_labels=num_labels, pad_token_id=PAD)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        cls = transformers.GPT2ForSequenceClassification
    else:
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32, rope_theta=5000.0, **common)
        cls = transformers.LlamaForSequenceClassification
    torch.manual_seed(0)
    model = cls(cfg).eval()
    _perturb(model)
    return model


@pytest.mark.parametrize("kind,num_labels", [("llama", 3), ("gpt2", 1), ("gpt2", 2)])
def test_gpt_family_classification_matches_hugging_face_and_round_trips(tmp_path, kind, num_labels):
    hf = _gpt_family(kind, num_labels)
    hf.save_pretrained(tmp_path / "hf")
    config, state, model_type = read_hf_directory(tmp_path / "hf")
    assert (config.head, config.num_labels, model_type) == ("classification", num_labels, kind)
    model = load_pretrained(tmp_path / "hf")
    assert isinstance(model, GPTModel) and model.output_layer is None
    ids, mask = _inputs()
    # Both take the same positions; a left-padded row's positions start at its first real token.
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    labels = _labels(num_labels)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=positions, labels=labels)
        logits = model(ids, positions, attention_mask=mask)
        loss = model(ids, positions, labels, attention_mask=mask)
    assert logits.shape == (B, num_labels) and loss.shape == (B,)
    assert (logits - ref.logits).abs().max() <= 1e-5
    assert (_hf_loss_of(loss, labels) - ref.loss).abs() <= 1e-6
    # Export: exactly Hugging Face's tensors and names; reading the export back gives the same mg state.
    out = write_hf_directory(tmp_path / "out", model.state_dict(), config, model_type, {"pad_token_id": PAD})
    saved, exported = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(exported) == set(saved)
    assert all(torch.equal(exported[k], v) for k, v in saved.items())
    config2, state2, _ = read_hf_directory(out)
    assert config2 == config and set(state2) == set(state)
    assert all(torch.equal(state2[k], v) for k, v in model.state_dict().items())
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(reloaded) is type(hf)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, attention_mask=mask, position_ids=positions).logits, ref.logits,
                                   atol=0, rtol=0)
    _check_streaming_groups(tmp_path / "hf", GPTModel)


def _bert(num_labels: int) -> torch.nn.Module:
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=24, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=num_labels)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).eval()
    _perturb(model)
    return model


@pytest.mark.parametrize("num_labels", [3, 1])
def test_bert_classification_matches_hugging_face_and_round_trips(tmp_path, num_labels):
    hf = _bert(num_labels)
    hf.save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf")
    assert isinstance(model, BertModel) and model.config.head == "classification"
    assert model.lm_head is None and model.binary_head is None and not model.config.add_binary_head
    ids, mask = _inputs()
    token_types = torch.randint(0, 2, (B, S), generator=torch.Generator().manual_seed(3))
    labels = _labels(num_labels)
    with torch.no_grad():
        ref = hf(ids, token_type_ids=token_types, attention_mask=mask, labels=labels)
        logits = model(ids, token_types, mask)
        loss = model(ids, token_types, mask, labels=labels)
    assert logits.shape == (B, num_labels)
    assert (logits - ref.logits).abs().max() <= 1e-5
    assert (_hf_loss_of(loss, labels) - ref.loss).abs() <= 1e-6
    write_hf_bert(tmp_path / "out", model.state_dict(), model.config)
    saved, exported = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "out"))
    assert set(exported) == set(saved)
    assert all(torch.equal(exported[k], v) for k, v in saved.items())
    config, state = read_hf_bert(tmp_path / "out")
    assert config == model.config
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        again = reloaded(ids, token_type_ids=token_types, attention_mask=mask).logits
    torch.testing.assert_close(again, ref.logits, atol=0, rtol=0)
    _check_streaming_groups(tmp_path / "hf", BertModel)


def test_bert_classification_gradients_match_hugging_face():
    hf = _bert(3)
    from mg_models.bert.hf import state_from_hf

    model = BertModel(bert_config_from_hf({**hf.config.to_dict(), "architectures": ["BertForSequenceClassification"]}))

    model.load_state_dict(state_from_hf(hf.state_dict(), model.config))
    ids, mask = _inputs()
    labels = _labels(3)
    hf(ids, attention_mask=mask, labels=labels).loss.backward()
    _hf_loss_of(model(ids, attention_mask=mask, labels=labels), labels).backward()
    hf_grads = state_from_hf({n: p.grad for n, p in hf.named_parameters()}, model.config)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, hf_grads[n], atol=1e-6, rtol=1e-5, msg=n)


CONFIGS = {
    "llama": (GPTConfig, dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                              ffn_hidden_size=96, vocab_size=VOCAB, max_position_embeddings=32,
                              position_embedding="rope", normalization="rmsnorm", activation="swiglu",
                              add_bias_linear=False, tie_word_embeddings=False, head="classification", num_labels=3)),
    "bert": (BertConfig, dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB,
                              max_position_embeddings=32, head="classification", num_labels=3)),
}


def _train_step(name: str, grid, sp: bool) -> dict[str, object]:
    cls, fields = CONFIGS[name]
    model = (GPTModel if cls is GPTConfig else BertModel)(cls(**fields), grid, sequence_parallel=sp, seed=9)
    ids, mask = _inputs()
    labels = _labels(3)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask)
    loss = model(ids, attention_mask=mask, labels=labels)
    loss.sum().backward()
    return {"logits": logits, "loss": loss.detach(), "model": model}


def tp_worker() -> dict[str, dict[str, object]]:
    from mg_parallel.tensor_parallel import allreduce_sequence_parallel_grads

    torch.set_num_threads(1)
    grid = build_grid(ParallelDims(tp=2))
    out = {}
    for name in sorted(CONFIGS):
        for sp in (False, True):
            res = _train_step(name, grid, sp)
            model = res.pop("model")
            allreduce_sequence_parallel_grads(model, grid.tp_group)
            res["grads"] = {n: _full(p.grad, p, grid.tp_group) for n, p in model.named_parameters()}
            out[f"{name} sp={sp}"] = res
    return out


def test_classification_heads_under_tensor_and_sequence_parallelism():
    from mg_parallel.grid import ProcessGrid

    refs = {name: _train_step(name, ProcessGrid.single(), False) for name in CONFIGS}
    for rank_out in run_distributed(tp_worker, 2):
        for key, res in rank_out.items():
            ref = refs[key.split()[0]]
            torch.testing.assert_close(res["logits"], ref["logits"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(res["loss"], ref["loss"], atol=1e-5, rtol=1e-5)
            for n, p in ref["model"].named_parameters():
                torch.testing.assert_close(res["grads"][n], p.grad, atol=1e-5, rtol=1e-4, msg=f"{key} {n}")


def test_heads_are_replicated_and_not_tied():
    gpt = GPTModel(GPTConfig(**{**CONFIGS["llama"][1], "tie_word_embeddings": True}))
    assert gpt.output_layer is None and not gpt.score.weight.tensor_parallel
    assert not hasattr(gpt.embedding.word_embeddings.weight, "shared_embedding")
    bert = dict(BertModel(BertConfig(**CONFIGS["bert"][1])).named_parameters())
    assert {"pooler.weight", "classifier.weight", "classifier.bias"} <= set(bert)
    assert not any(n.startswith(("lm_head", "binary_head")) for n in bert)
    assert not any(bert[n].tensor_parallel for n in ("pooler.weight", "classifier.weight"))


def test_classification_loss_and_config_errors():
    logits = torch.randn(2, 3)
    multi = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    torch.testing.assert_close(classification_loss(logits, multi).mean(),
                               torch.nn.functional.binary_cross_entropy_with_logits(logits, multi))
    with pytest.raises(ValueError, match=r"integer class labels must have shape \[batch\] = \[2\]"):
        classification_loss(logits, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="num_labels=1 .regression. needs float labels"):
        classification_loss(logits[:, :1], torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="model.head='seq2seq'"):
        GPTConfig(**{**CONFIGS["llama"][1], "head": "seq2seq"})
    with pytest.raises(ValueError, match="model.num_labels must be a positive integer"):
        GPTConfig(**{**CONFIGS["llama"][1], "num_labels": 0})
    with pytest.raises(ValueError, match="model.classifier_dropout"):
        BertConfig(**CONFIGS["bert"][1], classifier_dropout=1.5)
    hf = {**_bert(2).config.to_dict(), "architectures": ["BertForSequenceClassification"], "problem_type": "regression"}
    with pytest.raises(ValueError, match="problem_type='regression' with 2 labels is not supported"):
        bert_config_from_hf(hf)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_count_and_flops_of_classification_models(name):
    """References: the built model's parameters and torch's FlopCounterMode over a forward+backward (math SDPA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from mg_models import flops_per_token, num_parameters

    cls, fields = CONFIGS[name]
    config = cls(**fields)
    model = (GPTModel if cls is GPTConfig else BertModel)(config)
    if cls is GPTConfig:
        padding_rows = config.padded_vocab_size - config.vocab_size
        assert sum(p.numel() for p in model.parameters()) - padding_rows * config.hidden_size == num_parameters(config)
    ids, mask = _inputs()
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(ids, attention_mask=mask, labels=_labels(3)).sum().backward()
    assert flops_per_token(config, S) == pytest.approx(counter.get_total_flops() / (B * S), rel=1e-12)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_classification_pipeline_stages_equal_full_model(name):
    cls, fields = CONFIGS[name]
    model_cls = GPTModel if cls is GPTConfig else BertModel
    config = cls(**fields)
    full = model_cls(config, seed=9)
    stage0 = model_cls(config, post_process=False, layer_range=(0, 1), seed=9)
    stage1 = model_cls(config, pre_process=False, layer_range=(1, 2), seed=9)
    ids, mask = _inputs()
    with torch.no_grad():
        stage1.set_input_tensor(stage0(ids, attention_mask=mask))
        torch.testing.assert_close(stage1(ids, attention_mask=mask, labels=_labels(3)),
                                   full(ids, attention_mask=mask, labels=_labels(3)), atol=1e-6, rtol=1e-6)
