"""JSONL to Megatron ``.bin/.idx``: multi-process, bounded memory, resumable, deterministic.

The input is cut into line-aligned partitions of ``partition_bytes`` (cut points depend only on
the input, never on the number of workers). Each worker tokenizes whole partitions into partial
datasets under ``OUTPUT_PREFIX.parts-<fingerprint>/`` and marks each one complete with a
``.done`` file; the partials are then merged in input order into
``OUTPUT_PREFIX_{key}_{document|sentence}.bin/.idx``. A rerun after a crash skips partitions that
already have their marker, so the output is byte-identical whatever ``workers`` is and however
often the run was interrupted.

``format="sft"`` reads conversations instead (see ``mg_data.sft``) and writes
``OUTPUT_PREFIX_text_document`` and ``OUTPUT_PREFIX_loss_mask_document`` (uint8), one sequence
per conversation, with identical lengths. ``format="classification"`` and ``format="seq2seq"``
write one sequence per example to each field's dataset (see ``mg_data.classification`` and
``mg_data.seq2seq``); classification labels get their final ids when the partitions are merged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from itertools import chain
from multiprocessing import get_context
from typing import Any

import numpy as np

from mg_data import classification
from mg_data._partition import MAX_EXAMPLES, STATE, mark_done, marker_path, part_prefix, record_bad
from mg_data.indexed import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, optimal_dtype
from mg_data.jsonl import (
    BadLineError,
    byte_range_chunks,
    count_lines_before,
    expand_inputs,
    is_compressed,
    open_binary,
    parse_line,
    stream_chunks,
)
from mg_data.preprocess_formats import EXAMPLE_FIELDS, process_examples, process_sft
from mg_data.sentences import get_splitter
from mg_data.sft import (
    ON_LONG,
    BadConversationError,
    load_chat_template,
)
from mg_data.tokenizers import Tokenizer, TokenizerSpec

_FORMAT_VERSION = 1
_BATCH_CHARS = 1 << 22  # tokenize ~4M characters at a time so token lists stay small


@dataclass(kw_only=True)
class PreprocessConfig:
    """Options of ``mg preprocess``."""

    input: Sequence[str]
    """JSONL files or globs (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``), read in the order given."""
    output_prefix: str
    """Outputs are ``OUTPUT_PREFIX_{key}_document.bin/.idx`` (``_sentence`` with split_sentences)."""
    tokenizer_model: str | None
    """Tokenizer file: SentencePiece ``.model``, HF ``tokenizer.json``, GPT-2 ``vocab.json``."""
    tokenizer_type: str | None = None
    """Override the inferred type (Megatron names such as ``SentencePieceTokenizer`` accepted)."""
    vocab_size: int | None = None
    """Vocabulary size, only for ``NullTokenizer``."""
    json_keys: Sequence[str] = ("text",)
    """JSON keys to tokenize; one output pair per key."""
    append_eod: bool = False
    """Append the tokenizer's end-of-document id (SentencePiece ``eos_id()``) to every document."""
    split_sentences: bool = False
    """Store each sentence as its own sequence (documents still delimited by the document index)."""
    sentence_splitter: str = "simple"
    """``simple`` (built in) or ``nltk``."""
    workers: int = 1
    """Worker processes; 1 tokenizes in this process."""
    partition_bytes: int = 64 << 20
    """Input bytes per partition: the unit of parallel work, of resumption and of memory use."""
    skip_bad_lines: bool = False
    """Skip and count malformed lines instead of stopping at the first one."""
    keep_partitions: bool = False
    """Keep the partial datasets after merging (they are deleted by default)."""
    fsync: bool = False
    """fsync the merged outputs before renaming them into place (survives power loss; slower).
    Without it a crashed process still never leaves a half-written output under the final name."""
    start_method: str | None = None
    """Worker start method: ``fork`` or ``spawn``; None picks ``fork`` when this process runs a
    single Python thread on Linux (fast start), else ``spawn``."""
    format: str = "text"
    """``text`` (documents under json_keys), ``sft`` (conversations: tokens + loss-mask outputs),
    ``classification`` (text, text_pair, label) or ``seq2seq`` (input, target)."""
    chat_template: str = "auto"
    """SFT only: ``auto``, ``chatml``, ``tokenizer`` or a ``.jinja`` file (see ``load_chat_template``)."""
    seq_length: int | None = None
    """SFT only: the training sequence length; a conversation fits with at most seq_length + 1 tokens."""
    on_long: str = "error"
    """SFT only: a conversation over seq_length + 1 tokens: ``error``, ``truncate`` or ``drop``."""
    labels: Sequence[str] | None = None
    """Classification only: the label names in id order; None sorts the string labels found."""
    num_labels: int | None = None
    """Classification only: the number of classes (integer labels must lie below it)."""

    def __post_init__(self) -> None:
        if isinstance(self.input, str):
            self.input = [self.input]
        if not self.input:
            raise ValueError("input is empty; pass at least one JSONL file or glob")
        if isinstance(self.json_keys, str):
            self.json_keys = [self.json_keys]
        if not self.json_keys or len(set(self.json_keys)) != len(self.json_keys):
            raise ValueError(f"json_keys must be non-empty and distinct, got {list(self.json_keys)}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.partition_bytes < 1:
            raise ValueError(f"partition_bytes must be positive, got {self.partition_bytes}")
        if self.start_method not in (None, "fork", "spawn", "forkserver"):
            raise ValueError(f"start_method must be fork, spawn or forkserver, got {self.start_method!r}")
        if self.sentence_splitter not in ("simple", "nltk"):
            raise ValueError(f"sentence_splitter must be 'simple' or 'nltk', got {self.sentence_splitter!r}")
        if self.tokenizer_model is None and (self.tokenizer_type or "").lower() not in (
                "nulltokenizer", "null", "bytetokenizer", "byte"):
            raise ValueError("tokenizer_model is required unless tokenizer_type is NullTokenizer/ByteTokenizer")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.on_long not in ON_LONG:
            raise ValueError(f"on_long must be one of {', '.join(ON_LONG)}, got {self.on_long!r}")
        if self.seq_length is not None and self.seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {self.seq_length}")
        if self.format == "sft":
            if self.split_sentences or self.append_eod:
                raise ValueError("split_sentences and append_eod do not apply to format=sft "
                                 "(the chat template ends every turn)")
            if list(self.json_keys) != ["text"]:
                raise ValueError("json_keys do not apply to format=sft (lines hold messages or prompt/completion)")
        if self.format in EXAMPLE_FIELDS:
            if self.split_sentences or self.append_eod or list(self.json_keys) != ["text"]:
                raise ValueError(f"split_sentences, append_eod and json_keys do not apply to format={self.format} "
                                 f"(lines hold {', '.join(EXAMPLE_FIELDS[self.format])})")
            if self.seq_length is not None or self.on_long != "error":
                raise ValueError(f"seq_length and on_long do not apply to format={self.format}: examples are stored "
                                 "whole and the dataset config cuts them to its sequence lengths")
        if self.format == "classification":
            self.labels = classification.check_label_options(self.labels, self.num_labels)
        elif self.labels is not None or self.num_labels is not None:
            raise ValueError("labels and num_labels apply to format=classification only")

    @property
    def level(self) -> str:
        """``sentence`` when splitting sentences, else ``document`` (Megatron's output naming)."""
        return "sentence" if self.split_sentences else "document"

    def output_prefixes(self) -> dict[str, str]:
        """Output prefix of each JSON key (SFT: of ``text`` and ``loss_mask``; classification: ``text``,
        ``text_pair`` and ``label``; seq2seq: ``input`` and ``target``)."""
        keys = {**EXAMPLE_FIELDS, "sft": ("text", "loss_mask"),
                "classification": classification.FIELDS + (classification.LABEL_FIELD,)}.get(self.format, self.json_keys)
        return {k: f"{self.output_prefix}_{k}_{self.level}" for k in keys}

    def output_dtype(self, key: str, vocab_size: int) -> np.dtype[Any]:
        """Stored dtype of output ``key``: the token dtype, uint8 for the SFT loss mask."""
        return np.dtype(np.uint8 if self.format == "sft" and key == "loss_mask" else optimal_dtype(vocab_size))

    def tokenizer_spec(self) -> TokenizerSpec:
        """Picklable recipe of the tokenizer (rebuilt in each worker)."""
        kwargs = {"vocab_size": self.vocab_size} if self.vocab_size is not None else {}
        return TokenizerSpec(self.tokenizer_model, self.tokenizer_type, kwargs)


FORMATS = ("text", "sft", "classification", "seq2seq")


@dataclass
class ProgressInfo:
    """What a progress callback receives after each finished partition."""

    documents: int
    """Documents (input lines) processed in this run."""
    bytes: int
    """Input bytes processed in this run (decompressed)."""
    elapsed_s: float
    docs_per_s: float
    mb_per_s: float
    """Throughput in 10^6 bytes per second."""
    partitions_done: int
    """Partitions finished, including those resumed from an earlier run."""
    partitions_total: int | None
    """Total partitions, when known in advance (uncompressed inputs)."""
    total_bytes: int | None
    """Total input bytes, when known in advance (uncompressed inputs)."""


@dataclass
class PreprocessSummary:
    """Result of ``run_preprocess``."""

    outputs: dict[str, str]
    """Output prefix per JSON key."""
    documents: int = 0
    """Input lines parsed into documents (each key's empty ones are then dropped: empty_documents)."""
    tokens: dict[str, int] = field(default_factory=dict)
    """Tokens written per key (SFT: ``loss_mask`` counts the tokens in the loss)."""
    empty_documents: dict[str, int] = field(default_factory=dict)
    """Documents dropped per key because they produced no tokens."""
    bad_lines: int = 0
    """Lines skipped with ``skip_bad_lines``."""
    bad_line_examples: list[str] = field(default_factory=list)
    """``file:line: reason`` of the first few bad lines."""
    truncated: int = 0
    """SFT: conversations cut to seq_length + 1 tokens (``on_long="truncate"``) and kept."""
    dropped: int = 0
    """SFT: conversations left out (too long with ``on_long="drop"``, or without a loss token)."""
    pairs: int = 0
    """Classification: examples with a ``text_pair``."""
    labels: dict[str, Any] | None = None
    """Classification: what ``OUTPUT_PREFIX_labels.json`` holds (``label_names``, ``num_labels``, ``label_counts``)."""
    blank_lines: int = 0
    """Whitespace-only lines (skipped)."""
    input_bytes: int = 0
    partitions: int = 0
    partitions_resumed: int = 0
    """Partitions found complete from an earlier run and not redone."""
    elapsed_s: float = 0.0
    docs_per_s: float = 0.0
    mb_per_s: float = 0.0


@dataclass
class _Task:
    index: int
    path: str
    start: int
    end: int
    payload: bytes | None = None
    line_base: int | None = None


def _load_tokenizer(config: PreprocessConfig) -> Tokenizer:
    tok = config.tokenizer_spec().build()
    if config.append_eod and tok.eod is None:
        raise ValueError(f"{config.tokenizer_model}: tokenizer has no end-of-document id; drop --append-eod")
    return tok


def _init_worker(config: PreprocessConfig, parts_dir: str, tok: Tokenizer | None = None) -> None:
    tok = tok or _load_tokenizer(config)
    STATE.update(config=config, tok=tok, parts_dir=parts_dir, dtype=optimal_dtype(tok.vocab_size),
                  splitter=get_splitter(config.sentence_splitter) if config.split_sentences else None,
                  template=load_chat_template(config.chat_template, config.tokenizer_model)
                  if config.format == "sft" else None)


def _flatten(ids: list[list[int]], dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    # straight into the token dtype: an id that does not fit raises OverflowError instead of wrapping
    flat = np.fromiter(chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    return flat, lengths


def _write_batch(builder: IndexedDatasetBuilder, tok: Tokenizer, texts: list[str], cfg: PreprocessConfig,
                 splitter: Callable[[str], list[str]] | None) -> tuple[int, int]:
    """Tokenize ``texts`` into ``builder``; returns (tokens written, empty documents)."""
    eod = tok.eod
    if splitter is None:
        ids = tok.encode_batch(texts)
        kept = [x for x in ids if x]
        if cfg.append_eod:
            for x in kept:
                x.append(eod)
        flat, lengths = _flatten(kept, builder.dtype)
        builder.add_batch(flat, lengths)
        return int(lengths.sum()), len(ids) - len(kept)
    sents = [splitter(t) for t in texts]
    ids = tok.encode_batch(list(chain.from_iterable(sents)))
    seqs: list[list[int]] = []
    doc_ends: list[int] = []
    empty = 0
    pos = 0
    for s in sents:
        mine = [x for x in ids[pos:pos + len(s)] if x]
        pos += len(s)
        if not mine:
            empty += 1
            continue
        if cfg.append_eod:
            mine[-1].append(eod)
        seqs.extend(mine)
        doc_ends.append(len(seqs))
    flat, lengths = _flatten(seqs, builder.dtype)
    builder.add_batch(flat, lengths, np.asarray(doc_ends, dtype=np.int64))
    return int(lengths.sum()), empty


def _process(task: _Task) -> dict[str, Any]:
    """Tokenize one partition into partial datasets (runs in a worker); returns its statistics."""
    cfg: PreprocessConfig = STATE["config"]
    tok: Tokenizer = STATE["tok"]
    parts_dir = STATE["parts_dir"]
    if task.payload is not None:
        data = task.payload
    else:
        with open(task.path, "rb") as f:
            f.seek(task.start)
            data = f.read(task.end - task.start)
    lines = data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    keys = list(cfg.output_prefixes())
    stats: dict[str, Any] = {"index": task.index, "path": task.path, "start": task.start,
                             "line_base": task.line_base, "documents": 0, "bytes": len(data),
                             "bad_lines": 0, "bad": [], "blank_lines": 0, "truncated": 0, "dropped": 0,
                             "tokens": {k: 0 for k in keys}, "empty": {k: 0 for k in keys}}
    if cfg.format == "sft":
        return process_sft(task, lines, stats)
    if cfg.format in EXAMPLE_FIELDS:
        return process_examples(task, lines, stats)
    columns: list[list[str]] = [[] for _ in cfg.json_keys]
    for rel, raw in enumerate(lines, 1):
        if not raw.strip():
            stats["blank_lines"] += 1
            continue
        try:
            values = parse_line(raw, cfg.json_keys, task.path, None)
        except BadLineError as e:
            if record_bad(stats, rel, e.reason):
                return stats
            continue
        for col, v in zip(columns, values):
            col.append(v)
    stats["documents"] = len(columns[0])
    for key, texts in zip(cfg.json_keys, columns):
        prefix = part_prefix(parts_dir, task.index, key, cfg.level)
        # Partials skip fsync: a killed process loses nothing the page cache holds, and after a
        # machine crash the size checks on resume catch partials whose data never reached the disk.
        with IndexedDatasetBuilder(prefix, STATE["dtype"], durable=False) as builder:
            batch: list[str] = []
            chars = 0
            for t in texts:
                batch.append(t)
                chars += len(t)
                if chars >= _BATCH_CHARS:
                    n, e = _write_batch(builder, tok, batch, cfg, STATE["splitter"])
                    stats["tokens"][key] += n
                    stats["empty"][key] += e
                    batch, chars = [], 0
            if batch:
                n, e = _write_batch(builder, tok, batch, cfg, STATE["splitter"])
                stats["tokens"][key] += n
                stats["empty"][key] += e
    return mark_done(parts_dir, task.index, stats)


def _file_fingerprint(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _fingerprint(cfg: PreprocessConfig, files: list[str], template: str | None = None) -> str:
    tok_files: list[str] = []
    if cfg.tokenizer_model is not None:
        p = cfg.tokenizer_model
        tok_files = ([os.path.join(p, n) for n in sorted(os.listdir(p))] if os.path.isdir(p) else [p])
    desc = {
        "version": _FORMAT_VERSION,
        "inputs": [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files],
        "tokenizer": [(os.path.basename(p), _file_fingerprint(p)) for p in tok_files if os.path.isfile(p)],
        "config": {k: v for k, v in asdict(cfg).items()
                   if k not in ("input", "output_prefix", "workers", "keep_partitions", "tokenizer_model")},
        "template": template,
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=list).encode()).hexdigest()[:16]


def _tasks(files: list[str], chunk: int) -> Iterator[_Task]:
    index = 0
    for path in files:
        if not is_compressed(path):
            for start, end in byte_range_chunks(path, chunk):
                yield _Task(index, path, start, end)
                index += 1
        else:
            offset = lines = 0
            with open_binary(path) as f:
                for payload in stream_chunks(f, chunk):
                    yield _Task(index, path, offset, offset + len(payload), payload, lines)
                    offset += len(payload)
                    lines += payload.count(b"\n")
                    index += 1


def _partials_intact(parts_dir: str, index: int, config: PreprocessConfig) -> bool:
    # Partials are not fsynced, so after a machine crash a marker may outlive its data: check sizes.
    try:
        for key in config.output_prefixes():
            IndexedDataset(part_prefix(parts_dir, index, key, config.level)).close()
    except IndexedDatasetError:
        return False
    return True


def _start_method(config: PreprocessConfig) -> str:
    if config.start_method is not None:
        return config.start_method
    # fork skips re-importing numpy/sentencepiece in every worker; it is only safe while this
    # process has no other Python threads (a thread holding a lock would leave it held in the child).
    if sys.platform.startswith("linux") and threading.active_count() == 1:
        return "fork"
    return "spawn"


def _absolute_line(stats: dict[str, Any], rel: int) -> int:
    base = stats["line_base"]
    if base is None:
        base = count_lines_before(stats["path"], stats["start"])
    return base + rel


def run_preprocess(config: PreprocessConfig, progress: Callable[[ProgressInfo], None] | None = None
                   ) -> PreprocessSummary:
    """Tokenize JSONL input into one Megatron ``.bin/.idx`` pair per JSON key.

    Args:
        config: what to do.
        progress: called after every finished partition (e.g. to drive a progress bar).

    Returns:
        Counts, throughput and output prefixes.

    Raises:
        FileNotFoundError: an input is missing. ValueError: bad tokenizer or options.
        BadLineError: a malformed line without ``skip_bad_lines`` (names the file and line);
            ``BadConversationError`` with ``format="sft"``, also for a conversation over
            ``seq_length + 1`` tokens under ``on_long="error"``.
        ChatTemplateError (a ValueError): the chat template cannot be loaded.
    """
    t0 = time.perf_counter()
    files = expand_inputs(config.input)
    tok = _load_tokenizer(config)  # here first, so a bad tokenizer fails clearly before any worker starts
    template = (load_chat_template(config.chat_template, config.tokenizer_model).fingerprint
                if config.format == "sft" else None)
    parts_dir = f"{config.output_prefix}.parts-{_fingerprint(config, files, template)}"
    os.makedirs(parts_dir, exist_ok=True)
    outputs = config.output_prefixes()
    summary = PreprocessSummary(outputs=outputs, tokens={k: 0 for k in outputs},
                                empty_documents={k: 0 for k in outputs})
    plain = all(not is_compressed(f) for f in files)
    total_bytes = sum(os.path.getsize(f) for f in files) if plain else None
    task_list: Any = list(_tasks(files, config.partition_bytes)) if plain else _tasks(files, config.partition_bytes)
    total_parts = len(task_list) if plain else None
    done_stats: dict[int, dict[str, Any]] = {}
    run_docs = run_bytes = 0

    errors: list[dict[str, Any]] = []

    def finished(stats: dict[str, Any], resumed: bool) -> None:
        nonlocal run_docs, run_bytes
        if "error" in stats:
            errors.append(stats)
            return
        done_stats[stats["index"]] = stats
        if resumed:
            summary.partitions_resumed += 1
            return
        run_docs += stats["documents"]
        run_bytes += stats["bytes"]
        if progress is not None:
            dt = max(time.perf_counter() - t0, 1e-9)
            progress(ProgressInfo(documents=run_docs, bytes=run_bytes, elapsed_s=dt, docs_per_s=run_docs / dt,
                                  mb_per_s=run_bytes / dt / 1e6, partitions_done=len(done_stats),
                                  partitions_total=total_parts, total_bytes=total_bytes))

    def pending() -> Iterator[_Task]:
        for task in task_list:
            if errors:
                return
            marker = marker_path(parts_dir, task.index)
            if os.path.exists(marker) and _partials_intact(parts_dir, task.index, config):
                with open(marker) as f:
                    finished(json.load(f), resumed=True)
            else:
                yield task

    if config.workers == 1:
        _init_worker(config, parts_dir, tok)
        for task in pending():
            finished(_process(task), resumed=False)
    else:
        method = _start_method(config)
        # forked workers inherit the loaded tokenizer; spawned ones load their own
        inherited = tok if method == "fork" else None
        with ProcessPoolExecutor(config.workers, mp_context=get_context(method), initializer=_init_worker,
                                 initargs=(config, parts_dir, inherited)) as pool:
            inflight: set[Future[dict[str, Any]]] = set()
            try:
                for task in pending():
                    inflight.add(pool.submit(_process, task))
                    if len(inflight) >= 2 * config.workers:  # bounds memory for streamed payloads
                        done, inflight = wait(inflight, return_when=FIRST_COMPLETED)
                        for fut in done:
                            finished(fut.result(), resumed=False)
                for fut in inflight:
                    finished(fut.result(), resumed=False)
            except BaseException:
                for fut in inflight:
                    fut.cancel()
                raise

    if errors:
        # Partitions are submitted in order, so the first bad line is in the lowest failing one.
        first = min(errors, key=lambda st: st["index"])
        rel, reason = first["error"]
        error = BadConversationError if config.format == "sft" else BadLineError
        raise error(first["path"], _absolute_line(first, rel), reason)
    order = sorted(done_stats)
    level = config.level
    merged = dict(outputs)
    if config.format == "classification":
        del merged["label"]
        summary.pairs = sum(done_stats[i]["pairs"] for i in order)
        if not summary.pairs:  # single texts only: no text_pair output
            for d in (merged, outputs, summary.tokens, summary.empty_documents):
                del d["text_pair"]
        parts = [(part_prefix(parts_dir, i, "label", level), done_stats[i]["labels"],
                  lambda rel, s=done_stats[i]: (s["path"], _absolute_line(s, rel))) for i in order]
        summary.labels = classification.write_labels(
            parts, config.output_prefix, config.labels, config.num_labels,
            sum(done_stats[i]["documents"] for i in order), summary.pairs, durable=config.fsync)
    for key, out in merged.items():
        with IndexedDatasetBuilder(out, config.output_dtype(key, tok.vocab_size), durable=config.fsync) as builder:
            for i in order:
                builder.add_index(part_prefix(parts_dir, i, key, level))
    for i in order:
        s = done_stats[i]
        summary.documents += s["documents"]
        summary.bad_lines += s["bad_lines"]
        summary.blank_lines += s["blank_lines"]
        summary.input_bytes += s["bytes"]
        summary.truncated += s.get("truncated", 0)
        summary.dropped += s.get("dropped", 0)
        for k in outputs:
            summary.tokens[k] += s["tokens"][k]
            summary.empty_documents[k] += s["empty"][k]
        for rel, reason in s["bad"]:
            if len(summary.bad_line_examples) < MAX_EXAMPLES:
                summary.bad_line_examples.append(f"{s['path']}:{_absolute_line(s, rel)}: {reason}")
    summary.partitions = len(order)
    if not config.keep_partitions:
        shutil.rmtree(parts_dir, ignore_errors=True)
    summary.elapsed_s = time.perf_counter() - t0
    summary.docs_per_s = run_docs / summary.elapsed_s
    summary.mb_per_s = run_bytes / summary.elapsed_s / 1e6
    return summary
