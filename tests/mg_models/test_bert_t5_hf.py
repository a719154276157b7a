"""BERT and T5 parity with Hugging Face (fp32, CPU), export round trips and T5 KV-cache decoding.

Randomly initialised Hugging Face models (the independent reference) are saved with
``save_pretrained`` and loaded by mg from config.json + safetensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from mg_models import load_pretrained
from mg_models.bert import BertConfig, BertModel, load_hf_bert
from mg_models.bert.hf import read_hf_bert, write_hf_bert
from mg_models.t5 import T5Config, T5Model, get_t5_config, greedy_generate, load_hf_t5
from mg_models.t5.hf import config_from_hf, read_hf_t5, state_from_hf, state_to_hf, write_hf_t5

VOCAB = 301  # not a multiple of 128: exercises vocabulary padding


def _perturb(model: torch.nn.Module) -> None:
    # HF initialises norms to 1 and biases to 0; perturb every tensor so each mapping is actually tested.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))


def _bert(masked_lm: bool, type_vocab: int) -> torch.nn.Module:
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=24, type_vocab_size=type_vocab,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cls = transformers.BertForMaskedLM if masked_lm else transformers.BertForPreTraining
    torch.manual_seed(0)
    model = cls(cfg).eval()
    _perturb(model)
    return model


@pytest.mark.parametrize("masked_lm,types,padding", [(False, True, True), (False, False, False), (True, True, True)])
def test_bert_matches_hugging_face_and_round_trips(tmp_path, masked_lm, types, padding):
    hf = _bert(masked_lm, 2)
    hf.save_pretrained(tmp_path / "hf")
    model = load_hf_bert(str(tmp_path / "hf"))
    assert model.config.add_binary_head == (not masked_lm)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (3, 12), generator=gen)
    token_types = torch.randint(0, 2, (3, 12), generator=gen) if types else None
    mask = None
    if padding:
        mask = torch.ones(3, 12, dtype=torch.long)
        mask[1, 7:] = 0
        mask[2, 10:] = 0
    with torch.no_grad():
        ref = hf(ids, token_type_ids=token_types, attention_mask=mask)
        logits, binary = model(ids, token_types, mask)
    ref_logits = ref.logits if masked_lm else ref.prediction_logits
    loaded = load_pretrained(tmp_path / "hf")  # dispatches on config.json's model_type
    assert isinstance(loaded, BertModel)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, token_type_ids=token_types, attention_mask=mask)[0], logits,
                                   atol=0, rtol=0)
    assert logits.shape == (3, 12, VOCAB)
    assert (logits - ref_logits).abs().max() <= 1e-5
    if masked_lm:
        assert binary is None
    else:
        assert (binary - ref.seq_relationship_logits).abs().max() <= 1e-5
    # Export gives back exactly the tensors (and names) Hugging Face saved, minus tied aliases.
    write_hf_bert(tmp_path / "out", model.state_dict(), model.config)
    saved, exported = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(
        str(tmp_path / "out" / "model.safetensors"))
    saved = {k: v for k, v in saved.items() if not k.startswith("cls.predictions.decoder")}
    assert set(exported) == set(saved)
    for k, v in saved.items():
        assert torch.equal(exported[k], v), k
    config, state = read_hf_bert(tmp_path / "out")
    assert config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(state[k], v), k
    auto = transformers.AutoModelForMaskedLM if masked_lm else transformers.AutoModelForPreTraining
    reloaded = auto.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        again = reloaded(ids, token_type_ids=token_types, attention_mask=mask)
    torch.testing.assert_close(again.logits if masked_lm else again.prediction_logits, ref_logits, atol=0, rtol=0)


def test_bert_without_token_types(tmp_path):
    hf = _bert(False, 1)  # Hugging Face needs at least one token type
    hf.save_pretrained(tmp_path)
    model = load_hf_bert(str(tmp_path))
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, binary = model(ids)
        ref = hf(ids)
    assert (logits - ref.prediction_logits).abs().max() <= 1e-5
    assert (binary - ref.seq_relationship_logits).abs().max() <= 1e-5
    no_types = BertConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, type_vocab_size=0)
    with pytest.raises(ValueError, match="type_vocab_size=0"):
        BertModel(no_types)(ids, torch.zeros_like(ids))



def _hf_grads_as_mg(hf: torch.nn.Module, config: BertConfig) -> dict[str, torch.Tensor]:
    from mg_models.bert.hf import state_from_hf

    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in hf.named_parameters()}
    return state_from_hf(grads, config)


@pytest.mark.parametrize("mode", ["labels", "logits", "binary only"])
def test_bert_training_loss_and_grads_match_hugging_face(tmp_path, mode):
    """With lm_labels, mg projects only the labelled positions onto the vocabulary; with grad enabled the tied
    word-embedding gradient is completed in place. Loss per token and every gradient must still equal Hugging
    Face's full-logits computation, whether the loss uses mg's labels path, mg's full logits, or (the embedding
    gradient then taking its own path) no MLM head at all."""
    hf = _bert(False, 2).train()
    hf.save_pretrained(tmp_path)
    model = load_hf_bert(str(tmp_path)).train()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (3, 12), generator=gen)
    types = torch.randint(0, 2, (3, 12), generator=gen)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = 0
    labels = torch.where((torch.rand(3, 12, generator=gen) < 0.3) & mask.bool(), ids, -100)
    labels[0, 0], labels[2, 4] = 5, 5  # a repeated target id
    ids[1, 2] = ids[2, 3] = 7  # a repeated input id: its embedding-gradient rows add up
    nsp = torch.tensor([0, 1, 1])
    head_in_loss = mode != "binary only"

    out = hf(ids, token_type_ids=types, attention_mask=mask)
    ref_tok = F.cross_entropy(out.prediction_logits.reshape(-1, VOCAB), labels.reshape(-1),
                              reduction="none").view(3, 12)
    n = (labels != -100).sum()
    ref_loss = ref_tok.sum() / n + F.cross_entropy(out.seq_relationship_logits, nsp)
    if not head_in_loss:
        ref_loss = out.seq_relationship_logits.square().sum()
    ref_loss.backward()

    if mode == "logits":
        logits, binary = model(ids, types, mask)
        assert logits.shape == (3, 12, VOCAB)
        tok = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(3, 12)
    else:
        tok, binary = model(ids, types, mask, lm_labels=labels)
        assert tok.shape == (3, 12) and tok.dtype == torch.float32
        assert torch.equal(tok[labels == -100], torch.zeros_like(tok[labels == -100]))
    torch.testing.assert_close(tok, ref_tok.detach(), atol=1e-5, rtol=1e-5)
    loss = tok.sum() / n + F.cross_entropy(binary, nsp) if head_in_loss else binary.square().sum()
    loss.backward()
    ref_grads = _hf_grads_as_mg(hf, model.config)
    for name, p in model.named_parameters():
        if p.grad is None:
            assert not head_in_loss and name.startswith("lm_head") and not ref_grads[name].any(), name
            continue
        assert p.grad.layout == torch.strided and p.grad.is_contiguous(), name
        torch.testing.assert_close(p.grad, ref_grads[name], atol=2e-6, rtol=1e-4, msg=name)
    # A second backward pass of a retained graph gets no stale gradient from the first.
    model.zero_grad(set_to_none=True)
    tok, binary = model(ids, types, mask, lm_labels=labels)
    first = (tok.sum() + binary.sum()) if head_in_loss else binary.sum()
    first.backward(retain_graph=True)
    word_name = "embedding.word_embeddings.weight"
    word = model.get_parameter(word_name)
    once = word.grad.clone()
    first.backward()
    torch.testing.assert_close(word.grad, 2 * once, atol=1e-6, rtol=1e-5)
    # A pass that runs the projection's backward but not the lookup's leaves nothing for a later pass to reuse.
    model.zero_grad(set_to_none=True)
    tok, binary = model(ids, types, mask, lm_labels=labels)
    torch.autograd.grad(tok.sum(), [model.lm_head.bias], retain_graph=True)
    binary.sum().backward()
    hf.zero_grad(set_to_none=True)
    hf(ids, token_type_ids=types, attention_mask=mask).seq_relationship_logits.sum().backward()
    torch.testing.assert_close(word.grad, _hf_grads_as_mg(hf, model.config)[word_name], atol=2e-6, rtol=1e-4)

def _t5(ff: str, tie: bool) -> torch.nn.Module:
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
                                num_heads=4, feed_forward_proj=ff, tie_word_embeddings=tie, dropout_rate=0.0,
                                relative_attention_num_buckets=8, relative_attention_max_distance=12,
                                decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    _perturb(model)
    return model


def _t5_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, 20), generator=gen)  # longer than max_distance: log-spaced buckets used
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 13:] = 0
    return ids, mask, torch.randint(0, VOCAB, (2, 15), generator=gen)


@pytest.mark.parametrize("ff,tie", [("relu", True), ("gated-gelu", False)])
def test_t5_matches_hugging_face_and_round_trips(tmp_path, ff, tie):
    hf = _t5(ff, tie)
    hf.save_pretrained(tmp_path / "hf")
    model = load_hf_t5(str(tmp_path / "hf"))
    assert model.config.activation == ff and model.config.scale_output == tie
    ids, mask, dec = _t5_batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        logits, memory = model(ids, decoder_input_ids=dec, attention_mask=mask)
    assert logits.shape == (2, 15, VOCAB) and memory.shape == (20, 2, 32)
    assert (logits - ref).abs().max() <= 1e-5
    loaded = load_pretrained(tmp_path / "hf")  # dispatches on config.json's model_type
    assert isinstance(loaded, T5Model)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, decoder_input_ids=dec, attention_mask=mask)[0], logits, atol=0, rtol=0)
    write_hf_t5(tmp_path / "out", model.state_dict(), model.config)
    saved, exported = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(
        str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(saved)
    for k, v in saved.items():
        assert torch.equal(exported[k], v), k
    config, state = read_hf_t5(tmp_path / "out")
    assert config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(state[k], v), k
    # Greedy decoding with the KV cache equals full recomputation (mg's and Hugging Face's).
    cached = greedy_generate(model, ids, 6, attention_mask=mask)
    assert torch.equal(cached, greedy_generate(model, ids, 6, attention_mask=mask, use_cache=False))
    ref_gen = torch.zeros(2, 1, dtype=torch.long)  # Hugging Face greedy by full recomputation
    with torch.no_grad():
        for _ in range(6):
            step = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=ref_gen).logits[:, -1]
            ref_gen = torch.cat([ref_gen, step.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, ref_gen)


def test_t5_training_loss_and_grads_match_hugging_face():
    """The per-token loss and every gradient of a tied-head training step equal Hugging Face's (mg's two
    embedding lookups add their rows into the head's weight gradient in place)."""
    from mg_models.t5.hf import config_from_hf as t5_config_from_hf

    hf = _t5("relu", True).train()
    config = t5_config_from_hf(hf.config.to_dict(), has_lm_head=False)
    model = T5Model(config).train()
    model.load_state_dict(state_from_hf(hf.state_dict(), config))
    ids, mask, target = _t5_batch()
    ids[1, 4] = ids[0, 2] = target[0, 3]  # one id looked up by both stacks and predicted
    target[1, 12:] = -100
    dec = torch.cat([torch.zeros(2, 1, dtype=torch.long), target[:, :-1].clamp(min=0)], dim=1)
    logits = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
    ref_tok = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none").view(2, 15)
    ref_tok.sum().backward()
    tok, _ = model(ids, dec, mask, labels=target)
    torch.testing.assert_close(tok, ref_tok.detach(), atol=1e-5, rtol=1e-5)
    tok.sum().backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    ref_grads = state_from_hf(grads, config)
    for name, p in model.named_parameters():
        assert p.grad.layout == torch.strided and p.grad.is_contiguous(), name
        torch.testing.assert_close(p.grad, ref_grads[name], atol=2e-6, rtol=1e-4, msg=name)

def test_t5_untied_head_state_dict(tmp_path):
    """A separate lm_head (as T5 v1.1 checkpoints hold) maps onto output_layer.weight without scaling."""
    hf = _t5("gated-gelu", False)
    hf.lm_head.weight = torch.nn.Parameter(hf.shared.weight.detach() * 0.5 + 0.01)
    hf_state = hf.state_dict()
    config = config_from_hf(hf.config.to_dict(), has_lm_head=True)
    assert not config.tie_word_embeddings and not config.scale_output
    model = T5Model(config)
    model.load_state_dict(state_from_hf(hf_state, config))
    ids, mask, dec = _t5_batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        logits, _ = model(ids, dec, mask, gather_logits=True)
    assert (logits - ref).abs().max() <= 1e-5
    back = state_to_hf(model.state_dict(), config)
    assert torch.equal(back["lm_head.weight"], hf.lm_head.weight)


def test_t5_bad_configs_name_the_fields():
    base = get_t5_config("tiny-t5")
    with pytest.raises(ValueError, match="model.activation='gelu'"):
        T5Config(**{**base.to_dict(), "activation": "gelu"})
    with pytest.raises(ValueError, match="model.kv_channels"):
        T5Config(**{**base.to_dict(), "kv_channels": 0})
    with pytest.raises(ValueError, match="relative_attention_num_buckets"):
        T5Config(**{**base.to_dict(), "relative_attention_num_buckets": 7})
    with pytest.raises(ValueError, match="unknown T5 preset"):
        get_t5_config("t5-huge")
    with pytest.raises(ValueError, match="feed_forward_proj"):
        config_from_hf({**transformers.T5Config().to_dict(), "feed_forward_proj": "gated-silu"})


def test_hf_adapter_errors_name_the_key(tmp_path):
    from mg_models.bert import hf as hf_bert

    hf_config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                        intermediate_size=48).to_dict()
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        hf_bert.config_from_hf({**hf_config, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="position_embedding_type='relative_key'"):
        hf_bert.config_from_hf({**hf_config, "position_embedding_type": "relative_key"})
    config = hf_bert.config_from_hf(hf_config)
    state = hf_bert.state_to_hf(BertModel(config).state_dict(), config)
    with pytest.raises(ValueError, match="missing tensor 'bert.encoder.layer.0.attention.self.key.bias'"):
        hf_bert.state_from_hf({k: v for k, v in state.items() if not k.endswith("self.key.bias")}, config)
    with pytest.raises(ValueError, match="does not know: \\['bert.extra'\\]"):
        hf_bert.state_from_hf({**state, "bert.extra": torch.zeros(1)}, config)
    with pytest.raises(ValueError, match="pre_layernorm"):
        hf_bert.config_to_hf(BertConfig(**{**config.to_dict(), "pre_layernorm": True}))
    (tmp_path / "config.json").write_text('{"model_type": "t5"}')
    with pytest.raises(ValueError, match="model_type='t5', expected 'bert'"):
        read_hf_bert(tmp_path)
    with pytest.raises(ValueError, match="model_type='t5' config lacks required keys \\['num_layers'"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "bert", "num_hidden_layers": 2}')
    with pytest.raises(ValueError, match="model_type='bert' config lacks required keys \\['hidden_size'"):
        load_pretrained(tmp_path)
    t5_config = get_t5_config("tiny-t5")
    t5_state = state_to_hf(T5Model(t5_config).state_dict(), t5_config)
    with pytest.raises(ValueError, match="missing tensors \\['encoder.final_layer_norm.weight'\\]"):
        state_from_hf({k: v for k, v in t5_state.items() if k != "encoder.final_layer_norm.weight"}, t5_config)
