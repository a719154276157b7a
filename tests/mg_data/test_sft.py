"""SFT data: chat templates and loss masks token by token, bad lines, length policies, packing, preprocessing."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from mg_data import (
    BadConversationError,
    ChatMLTemplate,
    ChatTemplateError,
    ConversationList,
    IndexedConversations,
    PreprocessConfig,
    SFTDataset,
    SFTDatasetConfig,
    build_sft_datasets,
    encode_prompt,
    load_chat_template,
    render_conversation,
    run_preprocess,
    tokenize_jsonl,
)
from mg_data.sft import JinjaChatTemplate, RenderedText, read_conversations, tokenize_rendered
from mg_data.sft_dataset import build_pack_index, pack_best_fit, pack_sequential
from mg_data.tokenizers import ByteTokenizer, build_tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ciao"}]
CHATML_JINJA = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                "{% endif %}")
# ChatML whose generation blocks leave the newline after <|im_end|> out of the loss
MARKED_JINJA = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
                "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
                "{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}")
BYTES = ByteTokenizer()


def trained_text(tokens, mask):
    """The bytes of the tokens in the loss, '·' for each masked one (ByteTokenizer)."""
    return "".join(chr(t) if m else "·" for t, m in zip(tokens.tolist(), mask.tolist()))


def write_lines(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def conversations(n, seed=0):
    """``n`` conversations of varied lengths, some with several assistant turns."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "sys"}] if i % 3 == 0 else []
        for k in range(1 + i % 3):
            turns += [{"role": "user", "content": f"q{i}-{k} " + "x" * int(rng.integers(0, 30))},
                      {"role": "assistant", "content": f"a{i}-{k} " + "y" * int(rng.integers(0, 40))}]
        out.append({"messages": turns} if i % 4 else {"prompt": turns[-2]["content"], "completion": turns[-1]["content"]})
    return out


# ---- templates and masks ------------------------------------------------------------------------

def test_chatml_text_and_mask_token_by_token():
    tokens, mask = render_conversation(CHAT, BYTES, ChatMLTemplate())
    text = bytes(tokens.tolist()).decode()
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                    "<|im_start|>assistant\nCiao<|im_end|>\n")
    assert mask.dtype == np.uint8 and len(mask) == len(tokens)
    expected = "".join(seg if train else "·" * len(seg) for seg, train in [
        ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hello!<|im_end|>\n", 1), ("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Ciao<|im_end|>\n", 1)])
    assert trained_text(tokens, mask) == expected  # end of turn in the loss; headers, user, system not


def test_prompt_completion_is_one_user_and_one_assistant_turn(tmp_path):
    path = write_lines(tmp_path / "pc.jsonl", [{"prompt": "2+2?", "completion": "4"}])
    (_, line, messages), = read_conversations([path])
    assert line == 1 and messages == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    tokens, mask = tokenize_jsonl([path], BYTES, ChatMLTemplate()).get(0)
    assert trained_text(tokens, mask).strip("·") == "4<|im_end|>\n"


def test_pieces_are_tokenised_separately_and_exactly(sp_model):
    tok = build_tokenizer(sp_model)
    tokens, mask = render_conversation(CHAT, tok, ChatMLTemplate())
    r = ChatMLTemplate().render(CHAT)
    cuts = [0] + [c for span in r.spans for c in span] + [len(r.text)]
    pieces = [r.text[a:b] for a, b in zip(cuts, cuts[1:])]
    expected = [(i, k % 2) for k, p in enumerate(pieces) for i in tok.encode(p)]
    assert tokens.tolist() == [i for i, _ in expected] and mask.tolist() == [m for _, m in expected]
    assert "".join(tok.decode(tokens[mask == 1].tolist()).split()) == "Hello!<|im_end|>Ciao<|im_end|>"
    # a prompt encodes as the training tokens up to the second assistant's content
    prompt = encode_prompt(CHAT[:4], tok, ChatMLTemplate())
    assert prompt == tokens[:len(prompt)].tolist() and mask[len(prompt)] == 1 and not mask[len(prompt) - 1]


def test_spans_may_not_overlap():
    with pytest.raises(ChatTemplateError, match="overlap"):
        tokenize_rendered([RenderedText("abcdef", [(1, 4), (3, 5)])], BYTES)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json with ChatML special tokens and a ChatML chat_template."""
    import tokenizers as hft
    d = tmp_path_factory.mktemp("hf_chat")
    tok = hft.Tokenizer(hft.models.BPE(unk_token=None))
    tok.pre_tokenizer = hft.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hft.decoders.ByteLevel()
    trainer = hft.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                      initial_alphabet=hft.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([json.dumps(c) for c in conversations(50)] * 3, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML_JINJA, "eos_token": {"content": "<|im_end|>", "__type": "AddedToken"},
         "bos_token": None}))
    return d


def test_tokenizer_chat_template_matches_builtin_chatml(hf_dir):
    tok = build_tokenizer(hf_dir)
    template = load_chat_template("auto", hf_dir)
    assert isinstance(template, JinjaChatTemplate) and not template.has_generation_marks
    assert template.special_tokens == {"eos_token": "<|im_end|>"}
    assert load_chat_template("tokenizer", hf_dir / "tokenizer.json").source == CHATML_JINJA
    tokens, mask = render_conversation(CHAT, tok, template)
    ref_tokens, ref_mask = render_conversation(CHAT, tok, ChatMLTemplate())
    assert tokens.tolist() == ref_tokens.tolist() and mask.tolist() == ref_mask.tolist()
    im_end, im_start = tok.tok.token_to_id("<|im_end|>"), tok.tok.token_to_id("<|im_start|>")
    assert (tokens == im_end).sum() == 5 and mask[tokens == im_end].tolist() == [0, 0, 1, 0, 1]
    assert not mask[tokens == im_start].any()
    assert tok.decode(tokens[mask == 1].tolist()) == "Hello!<|im_end|>\nCiao<|im_end|>\n"


def test_generation_blocks_give_the_spans(hf_dir, tmp_path):
    (tmp_path / "marked.jinja").write_text(MARKED_JINJA)
    template = load_chat_template(str(tmp_path / "marked.jinja"), hf_dir)
    assert template.has_generation_marks and template.special_tokens == {"eos_token": "<|im_end|>"}
    r = template.render(CHAT)
    assert r.text == ChatMLTemplate().render(CHAT).text
    assert [r.text[a:b] for a, b in r.spans] == ["Hello!<|im_end|>", "Ciao<|im_end|>"]
    tokens, mask = render_conversation(CHAT, BYTES, template)
    assert trained_text(tokens, mask).replace("·", " ").split() == ["Hello!<|im_end|>", "Ciao<|im_end|>"]
    assert trained_text(tokens, mask).endswith("Ciao<|im_end|>·")  # the newline closing the turn is masked


def test_rendering_matches_transformers(hf_dir):
    import transformers
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    hf.chat_template = MARKED_JINJA
    ours = JinjaChatTemplate(MARKED_JINJA)
    assert ours.render(CHAT).text == hf.apply_chat_template(CHAT, tokenize=False)
    out = hf.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    tokens, mask = render_conversation(CHAT, build_tokenizer(hf_dir), ours)
    assert tokens.tolist() == list(out["input_ids"]) and mask.tolist() == list(out["assistant_masks"])


def test_template_errors_are_one_line(hf_dir, tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text((hf_dir / "tokenizer.json").read_text())
    assert isinstance(load_chat_template("auto", tmp_path), ChatMLTemplate)  # no template: ChatML
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        load_chat_template("tokenizer", tmp_path)
    with pytest.raises(ChatTemplateError, match="unknown chat template 'llama'"):
        load_chat_template("llama", tmp_path)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        JinjaChatTemplate("{% for m in messages %}")
    # a template that renders earlier turns differently once later ones exist
    unstable = JinjaChatTemplate("{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="not prefix-stable at assistant turn 2"):
        unstable.render(CHAT)
    strict = JinjaChatTemplate("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}"
                               "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="rejects the conversation: no system"):
        strict.render(CHAT)
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(ChatTemplateError, match=r"needs jinja2: `pip install mg-data\[chat\]`") as e:
        load_chat_template("auto", hf_dir)
    assert "\n" not in str(e.value)


# ---- bad lines and lengths ----------------------------------------------------------------------

BAD_LINES = {
    "not json": ("{oops", "malformed JSON"),
    "no assistant": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    "unknown role": ({"messages": [{"role": "bot", "content": "hi"}]}, "role 'bot'"),
    "missing content": ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}, "has no 'content'"),
    "content not a string": ({"messages": [{"role": "assistant", "content": ["x"]}]}, "content holds list"),
    "completion not a string": ({"prompt": "p", "completion": 3}, "'completion' holds int"),
    "no form": ({"text": "x"}, "needs 'messages'"),
    "both forms": ({"prompt": "p", "completion": "c", "messages": []}, "both 'messages' and 'prompt'"),
    "empty messages": ({"messages": []}, "non-empty list"),
    "not an object": ([1, 2], "expected a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_names_file_and_line(case, tmp_path):
    line, reason = BAD_LINES[case]
    good = conversations(40)
    path = write_lines(tmp_path / "bad.jsonl", good[:30] + [""] + [line] + good[30:])  # the bad line is line 32
    for run in (lambda: tokenize_jsonl([path], BYTES, ChatMLTemplate()),
                lambda: run_preprocess(PreprocessConfig(input=[str(path)], output_prefix=str(tmp_path / "o"),
                                                        tokenizer_model=None, tokenizer_type="byte", format="sft",
                                                        chat_template="chatml", partition_bytes=500))):
        with pytest.raises(BadConversationError) as e:
            run()
        assert isinstance(e.value, ValueError) and (e.value.path, e.value.line) == (str(path), 32)
        assert str(e.value).startswith(f"{path}:32: ") and reason in str(e.value) and "\n" not in str(e.value)


def test_skip_bad_lines_counts_them(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", conversations(5) + ["{oops"] + conversations(3))
    s = run_preprocess(PreprocessConfig(input=[str(path)], output_prefix=str(tmp_path / "o"), tokenizer_model=None,
                                        tokenizer_type="byte", format="sft", skip_bad_lines=True))
    assert s.bad_lines == 1 and s.documents == 8 and s.bad_line_examples[0].startswith(f"{path}:6: malformed JSON")


def test_on_long_error_truncate_drop(tmp_path):
    convs = conversations(30)
    path = write_lines(tmp_path / "c.jsonl", convs)
    full = tokenize_jsonl([path], BYTES, ChatMLTemplate())
    seq = 120
    long = [i for i, n in enumerate(full.lengths.tolist()) if n > seq + 1]
    assert 3 < len(long) < 25
    with pytest.raises(BadConversationError, match=rf"^{path}:{long[0] + 1}: conversation has \d+ tokens, more than "
                                                   rf"seq_length \+ 1 = {seq + 1}; pass --on-long truncate or drop"):
        tokenize_jsonl([path], BYTES, ChatMLTemplate(), seq_length=seq)
    dropped = tokenize_jsonl([path], BYTES, ChatMLTemplate(), seq_length=seq, on_long="drop")
    assert dropped.counts.dropped == len(long) and len(dropped) == 30 - len(long)
    assert [t.tolist() for t, _ in dropped.conversations] == [full.get(i)[0].tolist() for i in range(30)
                                                              if i not in long]
    cut = tokenize_jsonl([path], BYTES, ChatMLTemplate(), seq_length=seq, on_long="truncate")
    kept = [i for i in range(30) if i not in long or full.get(i)[1][1:seq + 1].any()]
    assert cut.counts.truncated == len(long) - (30 - len(kept)) and cut.counts.dropped == 30 - len(kept)
    for (t, m), i in zip(cut.conversations, kept):
        assert t.tolist() == full.get(i)[0][:seq + 1].tolist() and m.tolist() == full.get(i)[1][:seq + 1].tolist()
    assert cut.counts.tokens == sum(len(t) for t, _ in cut.conversations) and max(cut.lengths) == seq + 1
    # the same policies in preprocessing
    for policy, counts in (("drop", dropped.counts), ("truncate", cut.counts)):
        s = run_preprocess(PreprocessConfig(input=[str(path)], output_prefix=str(tmp_path / policy), tokenizer_model=None,
                                            tokenizer_type="byte", format="sft", seq_length=seq, on_long=policy))
        assert (s.documents, s.dropped, s.truncated) == (30, counts.dropped, counts.truncated)
        assert (s.tokens["text"], s.tokens["loss_mask"]) == (counts.tokens, counts.loss_tokens)
    with pytest.raises(BadConversationError, match=rf"{path}:{long[0] + 1}: conversation has"):
        run_preprocess(PreprocessConfig(input=[str(path)], output_prefix=str(tmp_path / "e"), tokenizer_model=None,
                                        tokenizer_type="byte", format="sft", seq_length=seq, skip_bad_lines=True))


# ---- preprocessing round trip -------------------------------------------------------------------

def test_preprocess_round_trip_equals_in_memory(sp_model, tmp_path):
    path = write_lines(tmp_path / "c.jsonl", conversations(200))
    tok = build_tokenizer(sp_model)
    ref = tokenize_jsonl([path], tok, ChatMLTemplate(), seq_length=200, on_long="truncate")
    files = []
    for workers in (1, 2):
        s = run_preprocess(PreprocessConfig(input=[str(path)], output_prefix=str(tmp_path / f"w{workers}"),
                                            tokenizer_model=sp_model, format="sft", seq_length=200,
                                            on_long="truncate", workers=workers, partition_bytes=4000))
        assert s.partitions > 5 and s.outputs == {"text": str(tmp_path / f"w{workers}_text_document"),
                                                  "loss_mask": str(tmp_path / f"w{workers}_loss_mask_document")}
        assert (s.tokens["text"], s.tokens["loss_mask"], s.truncated) == (
            ref.counts.tokens, ref.counts.loss_tokens, ref.counts.truncated) and s.truncated > 0
        files.append([open(f"{p}.{ext}", "rb").read() for p in s.outputs.values() for ext in ("bin", "idx")])
    assert files[0] == files[1]
    stored = IndexedConversations(tmp_path / "w1")
    assert stored.masks.dtype == np.uint8 and stored.tokens.dtype == np.uint16 and len(stored) == len(ref)
    for i in range(len(ref)):
        t, m = stored.get(i)
        assert t.tolist() == ref.get(i)[0].tolist() and m.tolist() == ref.get(i)[1].tolist()
    # the dataset reads the files as it reads the in-memory conversations
    cfg = SFTDatasetConfig(seq_length=256, split="1", seed=3)
    (train, valid, test) = build_sft_datasets(cfg, [str(tmp_path / "w1_text_document")])
    assert valid is None and test is None
    memory = SFTDataset(ref, (0, len(ref)), None, cfg)
    assert len(train) == len(memory)
    for i in range(len(train)):
        a, b = train[i], memory[i]
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # output prefixes work as blend entries, split by conversations and mixed by weight
    train, valid, _ = build_sft_datasets(SFTDatasetConfig(seq_length=256, split="9,1"),
                                         ["0.7", str(tmp_path / "w1"), "0.3", str(tmp_path / "w2")], (60, 10, None))
    assert len(train) == 60 and len(valid) == 10
    assert sorted(set(int(train[i]["dataset_id"]) for i in range(60))) == [0, 1]
    valid_items = [int(c) for d in valid.datasets for c in d.pack_items]
    assert round(0.9 * len(ref)) == min(valid_items) and max(valid_items) == len(ref) - 1


def test_indexed_conversations_checks_the_pair(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", conversations(4))
    run_preprocess(PreprocessConfig(input=[str(path)], output_prefix=str(tmp_path / "a"), tokenizer_model=None,
                                    tokenizer_type="byte", format="sft"))
    run_preprocess(PreprocessConfig(input=[str(write_lines(tmp_path / "d.jsonl", conversations(5)))],
                                    output_prefix=str(tmp_path / "b"), tokenizer_model=None, tokenizer_type="byte",
                                    format="sft"))
    for ext in ("bin", "idx"):
        (tmp_path / f"a_loss_mask_document.{ext}").write_bytes((tmp_path / f"b_loss_mask_document.{ext}").read_bytes())
    with pytest.raises(ValueError, match="lengths or documents differ"):
        IndexedConversations(tmp_path / "a")
    with pytest.raises(ValueError, match="do not apply to format=sft"):
        PreprocessConfig(input=[str(path)], output_prefix="x", tokenizer_model=None, tokenizer_type="byte",
                         format="sft", append_eod=True)


# ---- packing ------------------------------------------------------------------------------------

def segments(sample):
    doc = sample["document_ids"]
    return [np.flatnonzero(doc == k) for k in range(doc.max() + 1)] if (doc >= 0).any() else []


@pytest.mark.parametrize("packing", ["best_fit", "sequential", "none"])
def test_packed_samples_are_whole_conversations_concatenated(packing, tmp_path):
    data = tokenize_jsonl([write_lines(tmp_path / "c.jsonl", conversations(120))], BYTES, ChatMLTemplate())
    s = 400
    cfg = SFTDatasetConfig(seq_length=s, packing=packing, seed=5, pad_id=7, create_attention_mask=True)
    ds = SFTDataset(data, (10, 110), 250, cfg)
    assert len(ds) >= 250
    seen = []
    for i in range(len(ds)):
        sample = ds[i]
        assert all(v.shape == (s,) for k, v in sample.items() if k != "attention_mask")
        items = ds.pack_items[ds.pack_offsets[i]:ds.pack_offsets[i + 1]].tolist()
        segs = segments(sample)
        assert len(segs) == len(items) and (packing != "none" or len(items) == 1)
        pos = 0
        for seg, c in zip(segs, items):
            one = ds.conversation_sample(c)
            tokens, mask = data.get(c)
            assert seg.tolist() == list(range(pos, pos + len(tokens) - 1))  # contiguous, never split
            assert sample["tokens"][seg].tolist() == tokens[:-1].tolist()
            assert sample["labels"][seg].tolist() == tokens[1:].tolist()
            assert sample["loss_mask"][seg].tolist() == mask[1:].tolist()
            assert sample["position_ids"][seg].tolist() == list(range(len(seg)))
            assert all(np.array_equal(sample[k][seg], one[k]) for k in one)
            pos += len(seg)
        pad = sample["document_ids"] == -1
        assert pad.tolist() == [False] * pos + [True] * (s - pos)
        assert (sample["tokens"][pad] == 7).all() and (sample["labels"][pad] == 7).all()
        assert not sample["loss_mask"][pad].any() and sample["position_ids"][pad].tolist() == list(range(s - pos))
        doc = sample["document_ids"]
        allowed = np.tri(s, dtype=bool) & (doc[:, None] == doc[None, :])
        assert sample["attention_mask"].shape == (1, s, s) and (sample["attention_mask"][0] == ~allowed).all()
        seen += items
    # every epoch holds each conversation of the range exactly once
    assert len(seen) % 100 == 0 and sorted(seen) == sorted(list(range(10, 110)) * (len(seen) // 100))
    again = SFTDataset(data, (10, 110), 250, cfg)
    assert np.array_equal(again.pack_items, ds.pack_items) and np.array_equal(again.pack_offsets, ds.pack_offsets)
    other = SFTDataset(data, (10, 110), 250, SFTDatasetConfig(seq_length=s, packing=packing, seed=6))
    assert not np.array_equal(other.pack_items, ds.pack_items)


def test_best_fit_packs_tighter_than_sequential():
    sizes = np.array([5, 3, 4, 2, 6, 1, 7, 1, 2])
    assert pack_sequential(sizes, 8) == [[0, 1], [2, 3], [4, 5], [6, 7], [8]]
    assert pack_best_fit(sizes, 8) == [[0, 1], [2, 3, 8], [4, 5], [6, 7]]
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 500, 2000)
    for pack in (pack_sequential, pack_best_fit):
        bins = pack(sizes, 1024)
        assert sorted(i for b in bins for i in b) == list(range(2000)) and max(sizes[b].sum() for b in bins) <= 1024
    assert len(pack_best_fit(sizes, 1024)) < 0.9 * len(pack_sequential(sizes, 1024))
    index = build_pack_index(np.arange(100, 2100), sizes, 1024, None, 0, "none", shuffle=False)
    assert index["pack_items"].tolist() == list(range(100, 2100)) and index["pack_offsets"].tolist() == list(range(2001))


def test_dataset_length_policy_and_cache(tmp_path):
    data = ConversationList([(np.arange(n) % 50, np.ones(n, np.uint8)) for n in (10, 40, 12, 80, 5)])
    with pytest.raises(ValueError, match=r"memory \(train split, conversations 0..5\): conversation 1 has 40 tokens, "
                                         r"more than seq_length \+ 1 = 33 \(2 such\)"):
        SFTDataset(data, (0, 5), None, SFTDatasetConfig(seq_length=32))
    drop = SFTDataset(data, (0, 5), None, SFTDatasetConfig(seq_length=32, on_long="drop", shuffle=False))
    assert drop.num_dropped == 2 and sorted(drop.pack_items.tolist()) == [0, 2, 4]
    cut = SFTDataset(data, (0, 5), None, SFTDatasetConfig(seq_length=32, on_long="truncate", packing="none",
                                                          cache_dir=str(tmp_path)))
    assert cut.num_truncated == 2 and cut.built_index
    sample = cut[int(np.flatnonzero(cut.pack_items == 3)[0])]
    assert sample["tokens"].tolist() == list(range(32)) and sample["labels"].tolist() == list(range(1, 33))
    cached = SFTDataset(data, (0, 5), None, SFTDatasetConfig(seq_length=32, on_long="truncate", packing="none",
                                                             cache_dir=str(tmp_path)))
    assert not cached.built_index and np.array_equal(cached.pack_items, cut.pack_items)
    with pytest.raises(IndexError):
        cut[len(cut)]
    for bad, match in ((dict(packing="greedy"), "packing must be one of"), (dict(on_long="cut"), "on_long must be"),
                       (dict(seq_length=0), "seq_length must be >= 1"), (dict(split="a"), "split"),
                       (dict(pad_id=-1), "pad_id")):
        with pytest.raises(ValueError, match=match):
            SFTDatasetConfig(**{"seq_length": 8, **bad})
