"""Supervised fine-tuning data: conversations, chat templates and exact loss masks.

A conversation is a JSONL line ``{"messages": [{"role": ..., "content": ...}, ...]}`` (roles
``system``, ``user``, ``assistant``) or ``{"prompt": ..., "completion": ...}`` (one user turn and
one assistant turn). A chat template renders it to text plus the character spans the model is
trained on: each assistant turn's content and its end-of-turn marker (for ChatML
``content<|im_end|>\\n``; the role header ``<|im_start|>assistant\\n`` is not trained on). The
text is cut at span boundaries and each piece is tokenised on its own, so the loss mask is exact
per token: ``tokens == concat(encode(piece) for piece in pieces)``.

Preprocessing (``PreprocessConfig(format="sft")``) stores the tokens and the mask as two indexed
datasets with identical lengths, one sequence per conversation: ``PREFIX_text_document`` and
``PREFIX_loss_mask_document`` (uint8). ``mg_data.sft_dataset`` packs them into samples.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

import numpy as np

from mg_data.indexed import IndexedDataset
from mg_data.jsonl import BadLineError, expand_inputs, load_json_line, open_binary
from mg_data.tokenizers import Tokenizer

ROLES = ("system", "user", "assistant")
ON_LONG = ("error", "truncate", "drop")
TOKENS_SUFFIX, MASK_SUFFIX = "_text_document", "_loss_mask_document"
# Private-use characters wrapped around {% generation %} blocks while rendering.
_GEN_OPEN, _GEN_CLOSE = "\ue000", "\ue001"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

Messages = list[dict[str, str]]


class BadConversationError(BadLineError):
    """A conversation line is malformed, or too long under ``on_long="error"``.

    The message is one line, ``FILE:LINE: reason``. Attributes as ``BadLineError``.
    """

    hint = ""


class ChatTemplateError(ValueError):
    """A chat template cannot be loaded, or rejects or cannot split a conversation."""



def conversation_from_json(obj: Any, path: str, line: int | None) -> Messages:
    """The messages of one parsed JSONL object (``messages`` or ``prompt``/``completion`` form).

    Raises:
        BadConversationError: not an object, neither or both forms, an unknown role, a missing or
            non-string content, or no assistant turn.
    """
    def bad(reason: str) -> BadConversationError:
        return BadConversationError(path, line, reason)

    if not isinstance(obj, dict):
        raise bad(f"expected a JSON object, got {type(obj).__name__}")
    has_messages, has_prompt = "messages" in obj, "prompt" in obj or "completion" in obj
    if has_messages and has_prompt:
        raise bad("has both 'messages' and 'prompt'/'completion'; keep one form")
    if has_prompt:
        for k in ("prompt", "completion"):
            if not isinstance(obj.get(k), str):
                raise bad(f"key {k!r} is missing" if k not in obj else
                          f"key {k!r} holds {type(obj[k]).__name__}, expected a string")
        return [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["completion"]}]
    if not has_messages:
        raise bad("needs 'messages' (a list of {role, content}) or 'prompt' and 'completion'")
    raw = obj["messages"]
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty list")
    out: Messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] is {type(m).__name__}, expected an object")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}] has role {role!r}; expected one of {', '.join(ROLES)}")
        if "content" not in m:
            raise bad(f"messages[{i}] has no 'content'")
        if not isinstance(m["content"], str):
            raise bad(f"messages[{i}].content holds {type(m['content']).__name__}, expected a string")
        out.append({"role": role, "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise bad("conversation has no assistant turn (nothing to train on)")
    return out


def parse_conversation(raw: bytes | str, path: str, line: int | None) -> Messages:
    """The messages of one raw JSONL line.

    Raises:
        BadConversationError: invalid UTF-8, malformed JSON, or as ``conversation_from_json``.
    """
    return conversation_from_json(load_json_line(raw, path, line, BadConversationError), path, line)


def read_conversations(inputs: Sequence[str | os.PathLike[str]]) -> Iterator[tuple[str, int, Messages]]:
    """``(file, line number, messages)`` of every non-blank line of ``inputs`` (files or globs).

    Raises:
        FileNotFoundError: an input matches no file. BadConversationError: at the first bad line.
    """
    for path in expand_inputs(inputs):
        with open_binary(path) as f:
            for n, raw in enumerate(f, 1):
                if raw.strip():
                    yield path, n, parse_conversation(raw, path, n)



class RenderedText(NamedTuple):
    """A rendered conversation: its text and the ``[start, end)`` character spans in the loss."""

    text: str
    spans: list[tuple[int, int]]


class ChatTemplate:
    """Renders messages to text and the character spans of the assistant turns."""

    name: str = "template"

    def render(self, messages: Messages, add_generation_prompt: bool = False) -> RenderedText:
        """The text of ``messages`` (plus the assistant header when ``add_generation_prompt``).

        Raises:
            ChatTemplateError: the template rejects the conversation or cannot split it.
        """
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """Hash of everything that determines the rendering."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class ChatMLTemplate(ChatTemplate):
    """``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per turn, no BOS.

    An assistant turn's loss span is ``{content}<|im_end|>\\n``: the end-of-turn marker and the
    newline closing the turn are trained on (the same span the prefix-diff rule finds in a
    Jinja ChatML template, so both paths give identical tokens and masks).
    """

    name = "chatml"

    def render(self, messages: Messages, add_generation_prompt: bool = False) -> RenderedText:
        parts: list[str] = []
        spans: list[tuple[int, int]] = []
        pos = 0
        for m in messages:
            head, body = f"<|im_start|>{m['role']}\n", f"{m['content']}<|im_end|>\n"
            pos += len(head)
            if m["role"] == "assistant":
                spans.append((pos, pos + len(body)))
            pos += len(body)
            parts += (head, body)
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return RenderedText("".join(parts), spans)


def _jinja_environment() -> Any:
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatTemplateError("a Jinja chat template needs jinja2: `pip install mg-data[chat]`, "
                                "or pass --chat-template chatml") from None

    class GenerationMarks(Extension):
        """``{% generation %}...{% endgeneration %}``: wraps the block in marker characters."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            return _GEN_OPEN + caller() + _GEN_CLOSE

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt: str) -> str:
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationMarks, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


class JinjaChatTemplate(ChatTemplate):
    """A Hugging Face-style Jinja chat template (``tokenizer_config.json``'s ``chat_template``).

    Rendered in a sandbox with ``messages``, ``add_generation_prompt`` and the special tokens
    (``bos_token``, ``eos_token``, ...). Loss spans: with ``{% generation %}`` blocks in the
    template, exactly those blocks. Without them, by prefix diff: for assistant turn ``k``,
    ``render(messages[:k], add_generation_prompt=True)`` (the prompt up to the assistant header)
    and ``render(messages[:k+1])`` must both be prefixes of the full rendering, and the span is
    the text between them (content and whatever the template closes the turn with).

    Raises:
        ChatTemplateError: jinja2 is missing or the template does not compile.
    """

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, name: str = "jinja") -> None:
        self.source, self.name = source, name
        self.special_tokens = dict(special_tokens or {})
        self.has_generation_marks = bool(_GENERATION_TAG.search(source))
        env = _jinja_environment()
        try:
            self._template = env.from_string(source)
        except Exception as e:  # jinja2.TemplateSyntaxError and friends
            raise ChatTemplateError(f"{name}: chat template does not compile ({e})") from None

    @property
    def fingerprint(self) -> str:
        desc = json.dumps([self.source, self.special_tokens], sort_keys=True)
        return "jinja-" + hashlib.sha256(desc.encode()).hexdigest()[:16]

    def _text(self, messages: Messages, add_generation_prompt: bool) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except Exception as e:  # raise_exception() in the template, or an error it runs into
            raise ChatTemplateError(f"chat template {self.name} rejects the conversation: {e}") from None

    def render(self, messages: Messages, add_generation_prompt: bool = False) -> RenderedText:
        if any(_GEN_OPEN in m["content"] or _GEN_CLOSE in m["content"] for m in messages):
            raise ChatTemplateError("content holds the private-use characters U+E000/U+E001")
        full = self._text(messages, add_generation_prompt)
        if self.has_generation_marks:
            return _split_marks(full)
        spans = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._text(messages[:k], True)
            upto = self._text(messages[:k + 1], False)
            if not (upto.startswith(before) and full.startswith(upto)):
                raise ChatTemplateError(
                    f"chat template {self.name} is not prefix-stable at assistant turn {k} (it renders "
                    "earlier turns differently once later ones exist); add {% generation %} blocks to "
                    "the template or use --chat-template chatml")
            spans.append((len(before), len(upto)))
        return RenderedText(full, spans)


def _split_marks(marked: str) -> RenderedText:
    text: list[str] = []
    spans: list[tuple[int, int]] = []
    pos, start = 0, None
    for piece in re.split(f"([{_GEN_OPEN}{_GEN_CLOSE}])", marked):
        if piece == _GEN_OPEN:
            if start is not None:
                raise ChatTemplateError("nested {% generation %} blocks")
            start = pos
        elif piece == _GEN_CLOSE:
            spans.append((start, pos))  # type: ignore[arg-type]
            start = None
        else:
            text.append(piece)
            pos += len(piece)
    return RenderedText("".join(text), spans)


def _special_token(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # a serialised AddedToken
        return value["content"]
    return None


def tokenizer_chat_template(tokenizer_path: str | os.PathLike[str] | None) -> tuple[str, dict[str, str]] | None:
    """The chat template of a Hugging Face tokenizer directory and its special tokens, or None.

    Looks beside ``tokenizer_path`` (a directory, or a file in one) for ``chat_template.jinja``
    or a ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of named templates
    of which ``default`` or else the first is taken).

    Raises:
        ChatTemplateError: ``tokenizer_config.json`` is not valid JSON.
    """
    if tokenizer_path is None:
        return None
    p = os.fspath(tokenizer_path)
    d = p if os.path.isdir(p) else os.path.dirname(p)
    config: dict[str, Any] = {}
    cfg_path = os.path.join(d, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        try:
            with open(cfg_path, encoding="utf-8") as f:
                config = json.load(f)
        except ValueError as e:
            raise ChatTemplateError(f"{cfg_path}: not valid JSON ({e})") from None
    specials = {k: v for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                if (v := _special_token(config.get(k))) is not None}
    jinja_path = os.path.join(d, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read(), specials
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default", next(iter(named.values()), None))
    return (source, specials) if isinstance(source, str) and source else None


def load_chat_template(name: str = "auto", tokenizer_path: str | os.PathLike[str] | None = None) -> ChatTemplate:
    """The chat template called ``name``.

    Args:
        name: ``auto`` (the tokenizer's own when it has one, else ChatML), ``chatml``,
            ``tokenizer`` (the tokenizer's own, required) or a path to a ``.jinja`` file.
        tokenizer_path: the tokenizer file or directory (where ``tokenizer_config.json`` is).

    Raises:
        ChatTemplateError: ``tokenizer`` without a tokenizer template, an unknown name, a missing
            jinja2 or a template that does not compile.
    """
    if name == "chatml":
        return ChatMLTemplate()
    if name in ("auto", "tokenizer"):
        found = tokenizer_chat_template(tokenizer_path)
        if found is not None:
            return JinjaChatTemplate(found[0], found[1], name=f"{tokenizer_path} chat_template")
        if name == "auto":
            return ChatMLTemplate()
        raise ChatTemplateError(f"{tokenizer_path}: no chat_template in tokenizer_config.json or "
                                "chat_template.jinja; pass --chat-template chatml or a .jinja file")
    if os.path.isfile(name):
        with open(name, encoding="utf-8") as f:
            source = f.read()
        found = tokenizer_chat_template(tokenizer_path)
        return JinjaChatTemplate(source, found[1] if found else {}, name=name)
    raise ChatTemplateError(f"unknown chat template {name!r}; use auto, chatml, tokenizer or a .jinja file path")


def _pieces(rendered: RenderedText) -> list[tuple[str, bool]]:
    cuts: list[tuple[str, bool]] = []
    pos = 0
    for a, b in rendered.spans:
        if a < pos or b < a:
            raise ChatTemplateError(f"loss spans overlap or run backwards: {rendered.spans}")
        cuts += [(rendered.text[pos:a], False), (rendered.text[a:b], True)]
        pos = b
    cuts.append((rendered.text[pos:], False))
    return [c for c in cuts if c[0]]


def tokenize_rendered(rendered: Sequence[RenderedText], tokenizer: Tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """Tokens (int64) and loss mask (uint8, 1 = trained on) of each rendered conversation.

    Each maximal piece of text inside or outside the loss spans is encoded on its own (one
    batched call for all distinct pieces), so a token is never half in the loss.
    """
    pieces = [_pieces(r) for r in rendered]
    distinct = list(dict.fromkeys(t for p in pieces for t, _ in p))
    ids = dict(zip(distinct, tokenizer.encode_batch(distinct)))
    out = []
    for p in pieces:
        toks = [ids[t] for t, _ in p]
        tokens = np.fromiter(chain.from_iterable(toks), dtype=np.int64, count=sum(len(t) for t in toks))
        mask = np.repeat(np.array([int(m) for _, m in p], dtype=np.uint8), [len(t) for t in toks])
        out.append((tokens, mask))
    return out


def render_conversation(messages: Messages, tokenizer: Tokenizer, template: ChatTemplate
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Tokens (int64, (n,)) and loss mask (uint8, (n,)) of one conversation.

    Raises:
        ChatTemplateError: the template rejects or cannot split the conversation.
    """
    return tokenize_rendered([template.render(messages)], tokenizer)[0]


def encode_prompt(messages: Messages, tokenizer: Tokenizer, template: ChatTemplate) -> list[int]:
    """Token ids of a generation prompt: ``messages`` and the assistant header, cut into pieces
    as in training, so for a prefix-stable template they are a prefix of the training tokens."""
    return tokenize_rendered([template.render(messages, add_generation_prompt=True)], tokenizer)[0][0].tolist()


def fit_length(tokens: np.ndarray, mask: np.ndarray, max_tokens: int | None, on_long: str
               ) -> tuple[np.ndarray, np.ndarray] | str:
    """Apply the length policy: ``(tokens, mask)`` to keep, or ``"drop"``, ``"error"``.

    A conversation of more than ``max_tokens`` tokens is cut to ``max_tokens`` (``truncate``),
    dropped or reported (``error``). One without any loss token after position 0 (nothing to
    train on, e.g. after truncation) is dropped.
    """
    if max_tokens is not None and len(tokens) > max_tokens:
        if on_long != "truncate":
            return on_long
        tokens, mask = tokens[:max_tokens], mask[:max_tokens]
    if not mask[1:].any():
        return "drop"
    return tokens, mask


def too_long_reason(n: int, max_tokens: int) -> str:
    """The one-line reason for a conversation over the length limit."""
    return (f"conversation has {n} tokens, more than seq_length + 1 = {max_tokens}; pass --on-long "
            "truncate or drop, or a larger --seq-length")


@dataclass
class SFTCounts:
    """What tokenising conversations did."""

    conversations: int = 0
    """Conversations read."""
    tokens: int = 0
    """Tokens kept."""
    loss_tokens: int = 0
    """Tokens in the loss."""
    truncated: int = 0
    """Conversations cut to the length limit (and kept)."""
    dropped: int = 0
    """Conversations left out: too long with ``drop``, or without a loss token."""


class ConversationList:
    """Tokenised conversations held in memory (the in-memory twin of ``IndexedConversations``)."""

    def __init__(self, conversations: Sequence[tuple[np.ndarray, np.ndarray]], name: str = "memory") -> None:
        self.conversations = [(np.asarray(t, np.int64), np.asarray(m, np.uint8)) for t, m in conversations]
        self.lengths = np.array([len(t) for t, _ in self.conversations], dtype=np.int64)
        self.prefix = name
        self.counts = SFTCounts()

    def __len__(self) -> int:
        return len(self.conversations)

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and loss mask of conversation ``i``."""
        return self.conversations[i]


def tokenize_jsonl(inputs: Sequence[str | os.PathLike[str]], tokenizer: Tokenizer, template: ChatTemplate,
                   seq_length: int | None = None, on_long: str = "error") -> ConversationList:
    """Read, render and tokenise conversations in memory (small data; preprocess large data).

    ``seq_length`` limits conversations to ``seq_length + 1`` tokens under ``on_long``; the result's
    ``counts`` say what happened.

    Raises:
        BadConversationError: a bad line, a template rejecting a line, or a too-long line under ``error``.
    """
    if on_long not in ON_LONG:
        raise ValueError(f"on_long must be one of {', '.join(ON_LONG)}, got {on_long!r}")
    limit = None if seq_length is None else seq_length + 1
    kept, counts = [], SFTCounts()
    for path, line, messages in read_conversations(inputs):
        counts.conversations += 1
        try:
            (tokens, mask), = tokenize_rendered([template.render(messages)], tokenizer)
        except ChatTemplateError as e:
            raise BadConversationError(path, line, str(e)) from None
        fitted = fit_length(tokens, mask, limit, on_long)
        if fitted == "error":
            raise BadConversationError(path, line, too_long_reason(len(tokens), limit))  # type: ignore[arg-type]
        if isinstance(fitted, str):
            counts.dropped += 1
            continue
        counts.truncated += len(fitted[0]) < len(tokens)
        counts.tokens += len(fitted[0])
        counts.loss_tokens += int(fitted[1].sum())
        kept.append(fitted)
    out = ConversationList(kept)
    out.counts = counts
    return out


def sft_prefixes(prefix: str | os.PathLike[str]) -> tuple[str, str]:
    """``(tokens prefix, loss-mask prefix)`` of a preprocessed SFT dataset, from the output prefix
    given to preprocessing (``out/chat``) or its tokens prefix (``out/chat_text_document``)."""
    p = os.fspath(prefix)
    if p.endswith(TOKENS_SUFFIX):
        p = p[: -len(TOKENS_SUFFIX)]
    return p + TOKENS_SUFFIX, p + MASK_SUFFIX


class IndexedConversations:
    """A preprocessed SFT dataset: tokens and loss masks, one sequence per conversation.

    Raises:
        IndexedDatasetError: a file is missing or malformed. ValueError: the two datasets disagree
            (lengths or documents), or documents are not single sequences.
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        tp, mp = sft_prefixes(prefix)
        self.tokens, self.masks = IndexedDataset(tp), IndexedDataset(mp)
        self.prefix = tp
        self.lengths = self.tokens.sequence_lengths
        if not np.array_equal(self.lengths, self.masks.sequence_lengths) or not np.array_equal(
                self.tokens.document_indices, self.masks.document_indices):
            raise ValueError(f"{mp}: sequence lengths or documents differ from {tp}; preprocess both again")
        if not np.array_equal(self.tokens.document_indices, np.arange(len(self.lengths) + 1)):
            raise ValueError(f"{tp}: not an SFT dataset (documents must be single sequences); "
                             "write it with mg preprocess --format sft")

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and loss mask of conversation ``i`` (memory-mapped views)."""
        return self.tokens.get(i), self.masks.get(i)
