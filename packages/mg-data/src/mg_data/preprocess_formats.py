"""The fine-tuning formats' partition workers of ``mg preprocess``: conversations into tokens and a loss mask
(``format="sft"``), labelled texts and input/target pairs into one dataset per field (``classification``,
``seq2seq``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from mg_data import classification, seq2seq
from mg_data._partition import STATE, mark_done, part_prefix, record_bad
from mg_data.finetune import encode_texts
from mg_data.indexed import IndexedDatasetBuilder
from mg_data.jsonl import BadLineError
from mg_data.sft import (
    BadConversationError,
    ChatTemplateError,
    fit_length,
    parse_conversation,
    tokenize_rendered,
    too_long_reason,
)

if TYPE_CHECKING:
    from mg_data.preprocess import PreprocessConfig, _Task

__all__ = ["EXAMPLE_FIELDS", "process_examples", "process_sft"]

EXAMPLE_FIELDS = {"classification": classification.FIELDS, "seq2seq": seq2seq.FIELDS}
"""The token fields each example format writes, one dataset per field."""

_SFT_BATCH = 1024  # conversations tokenised per call


def process_sft(task: _Task, lines: list[bytes], stats: dict[str, Any]) -> dict[str, Any]:
    """Render and tokenise the conversations of one partition into token + loss-mask partials."""
    cfg: PreprocessConfig = STATE["config"]
    template = STATE["template"]
    limit = None if cfg.seq_length is None else cfg.seq_length + 1
    rels, rendered = [], []
    for rel, raw in enumerate(lines, 1):
        if not raw.strip():
            stats["blank_lines"] += 1
            continue
        try:
            rendered.append(template.render(parse_conversation(raw, task.path, None)))
            rels.append(rel)
        except (BadConversationError, ChatTemplateError) as e:
            if record_bad(stats, rel, e.reason if isinstance(e, BadConversationError) else str(e)):
                break  # the lines before it may still hold an earlier, too-long conversation
    stats["documents"] = len(rendered)
    prefixes = {k: part_prefix(STATE["parts_dir"], task.index, k, cfg.level) for k in ("text", "loss_mask")}
    too_long = False
    with IndexedDatasetBuilder(prefixes["text"], STATE["dtype"], durable=False) as tb, \
            IndexedDatasetBuilder(prefixes["loss_mask"], np.uint8, durable=False) as mb:
        for b in range(0, len(rendered), _SFT_BATCH):
            if too_long:
                break
            kept = []
            for rel, (tokens, mask) in zip(rels[b:b + _SFT_BATCH],
                                           tokenize_rendered(rendered[b:b + _SFT_BATCH], STATE["tok"])):
                fitted = fit_length(tokens, mask, limit, cfg.on_long)
                if fitted == "error":
                    too_long = record_bad(stats, rel, too_long_reason(len(tokens), limit), skippable=False)  # type: ignore[arg-type]
                    break
                if isinstance(fitted, str):
                    stats["dropped"] += 1
                    continue
                stats["truncated"] += len(fitted[0]) < len(tokens)
                kept.append(fitted)
            if kept:
                lengths = np.array([len(t) for t, _ in kept], dtype=np.int64)
                masks = np.concatenate([m for _, m in kept])
                # ids are below vocab_size, which chose the dtype, so the cast cannot wrap
                tb.add_batch(np.concatenate([t for t, _ in kept]).astype(tb.dtype), lengths)
                mb.add_batch(masks, lengths)
                stats["tokens"]["text"] += int(lengths.sum())
                stats["tokens"]["loss_mask"] += int(masks.sum(dtype=np.int64))
        if "error" in stats:
            tb.abort()
            mb.abort()
            return stats
    return mark_done(STATE["parts_dir"], task.index, stats)


def process_examples(task: _Task, lines: list[bytes], stats: dict[str, Any]) -> dict[str, Any]:
    """Tokenise the examples of one partition into one partial per field (and, for classification,
    labels with partition-local ids for string labels; ``write_labels`` makes them final)."""
    cfg: PreprocessConfig = STATE["config"]
    encoder = (classification.LabelEncoder(cfg.labels, cfg.num_labels) if cfg.format == "classification" else None)
    rows: list[tuple[Any, ...]] = []
    for rel, raw in enumerate(lines, 1):
        if not raw.strip():
            stats["blank_lines"] += 1
            continue
        try:
            rows.append(classification.parse_classification(raw, task.path, None, encoder, rel, BadLineError)
                        if encoder is not None else seq2seq.parse_seq2seq(raw, task.path, None, BadLineError))
        except BadLineError as e:
            if record_bad(stats, rel, e.reason):
                return stats
    stats["documents"] = len(rows)
    for k, field_ in enumerate(EXAMPLE_FIELDS[cfg.format]):
        flat, lengths = encode_texts(STATE["tok"], [r[k] for r in rows], STATE["dtype"])
        with IndexedDatasetBuilder(part_prefix(STATE["parts_dir"], task.index, field_, cfg.level), STATE["dtype"],
                                   durable=False) as builder:
            builder.add_batch(flat, lengths)
        stats["tokens"][field_] = int(lengths.sum())
    if encoder is not None:
        with IndexedDatasetBuilder(part_prefix(STATE["parts_dir"], task.index, "label", cfg.level), np.int32,
                                   durable=False) as builder:
            builder.add_batch(np.array([r[2] for r in rows], dtype=np.int32), np.ones(len(rows), dtype=np.int64))
        stats["tokens"]["label"] = len(rows)
        stats["pairs"] = sum(r[1] is not None for r in rows)
        stats["labels"] = encoder.state()
    return mark_done(STATE["parts_dir"], task.index, stats)
