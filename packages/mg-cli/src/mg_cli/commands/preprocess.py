"""``mg preprocess``: JSONL text to Megatron-compatible ``.bin/.idx`` token datasets."""

from __future__ import annotations

import click


@click.command("preprocess", context_settings={"show_default": True})
@click.option("--input", "inputs", multiple=True, required=True, metavar="PATH|GLOB",
              help="JSONL input (.jsonl, .jsonl.gz, .jsonl.zst); repeat or use a glob.")
@click.option("--output-prefix", required=True, help="Outputs are PREFIX_{key}_document.bin/.idx.")
@click.option("--tokenizer-model", default=None, help="SentencePiece .model, tokenizer.json or GPT-2 vocab.json.")
@click.option("--tokenizer-type", default=None,
              help="Override the inferred type (SentencePieceTokenizer, HuggingFaceTokenizer, GPT2BPETokenizer, NullTokenizer).")
@click.option("--vocab-size", type=int, default=None, help="Vocabulary size (NullTokenizer only).")
@click.option("--json-keys", default="text", help="Comma-separated JSON keys; one output pair per key.")
@click.option("--append-eod", is_flag=True, help="Append the tokenizer's end-of-document id to every document.")
@click.option("--split-sentences", is_flag=True, help="One sequence per sentence (outputs named _sentence), as model.type=bert needs.")
@click.option("--workers", type=int, default=1, help="Worker processes.")
@click.option("--partition-mb", type=int, default=64, help="Input MB per partition (unit of work and of resumption).")
@click.option("--skip-bad-lines", is_flag=True, help="Skip and count malformed lines instead of stopping.")
@click.option("--format", "fmt", type=click.Choice(["text", "sft", "classification", "seq2seq"]), default="text",
              help="text: documents under --json-keys; sft: conversations ({messages} or {prompt, completion} "
                   "lines) to PREFIX_text_document + PREFIX_loss_mask_document; classification: {text, text_pair?, "
                   "label} lines to PREFIX_text_document (+ _text_pair_document), PREFIX_label_document and "
                   "PREFIX_labels.json; seq2seq: {input, target} lines to PREFIX_input_document + "
                   "PREFIX_target_document.")
@click.option("--chat-template", default="auto",
              help="sft: auto (the tokenizer's chat_template, else chatml), chatml, tokenizer, or a .jinja file.")
@click.option("--seq-length", type=int, default=None,
              help="sft: training sequence length; a conversation fits with at most seq-length + 1 tokens.")
@click.option("--on-long", type=click.Choice(["error", "truncate", "drop"]), default="error",
              help="sft: what to do with a conversation over seq-length + 1 tokens.")
@click.option("--labels", default=None, metavar="A,B,...",
              help="classification: comma-separated label names in id order (default: the string labels, sorted).")
@click.option("--num-labels", type=int, default=None,
              help="classification: number of classes (integer labels must lie below it).")
def preprocess(inputs: tuple[str, ...], output_prefix: str, tokenizer_model: str | None, tokenizer_type: str | None,
               vocab_size: int | None, json_keys: str, append_eod: bool, split_sentences: bool, workers: int,
               partition_mb: int, skip_bad_lines: bool, fmt: str, chat_template: str, seq_length: int | None,
               on_long: str, labels: str | None, num_labels: int | None) -> None:
    """Tokenize JSONL documents into indexed datasets (resumable, deterministic for any --workers).

    \b
    Example:
      mg preprocess --input corpus.jsonl --tokenizer-model tok.model \\
                    --output-prefix data/corpus --append-eod --workers 2
      # -> data/corpus_text_document.bin / .idx
      mg preprocess --format sft --input chats.jsonl --tokenizer-model tok/ \\
                    --output-prefix data/chats --seq-length 4096 --on-long drop
      # -> data/chats_text_document + data/chats_loss_mask_document (.bin / .idx)
      mg preprocess --format classification --input train.jsonl --tokenizer-model tok.model \\
                    --output-prefix data/sst2
      # -> data/sst2_text_document, data/sst2_label_document (.bin / .idx), data/sst2_labels.json
    """
    from mg_cli.progress import preprocess_progress
    from mg_data import BadLineError, IndexedDatasetError, PreprocessConfig, run_preprocess

    try:
        config = PreprocessConfig(
            input=list(inputs), output_prefix=output_prefix, tokenizer_model=tokenizer_model,
            tokenizer_type=tokenizer_type, vocab_size=vocab_size,
            json_keys=[k.strip() for k in json_keys.split(",") if k.strip()], append_eod=append_eod,
            split_sentences=split_sentences, workers=workers, partition_bytes=partition_mb << 20,
            skip_bad_lines=skip_bad_lines, format=fmt, chat_template=chat_template, seq_length=seq_length,
            on_long=on_long, num_labels=num_labels,
            labels=None if labels is None else [x.strip() for x in labels.split(",") if x.strip()],
        )
        with preprocess_progress() as progress:
            summary = run_preprocess(config, progress=progress)
    except (ValueError, OSError, BadLineError, IndexedDatasetError) as e:
        raise click.ClickException(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    if fmt == "sft":
        written = summary.documents - summary.dropped
        click.echo(f"{summary.outputs['text']}.bin/.idx + {summary.outputs['loss_mask']}.bin/.idx: "
                   f"{summary.documents} conversations, {written} written, {summary.tokens['text']} tokens "
                   f"({summary.tokens['loss_mask']} in the loss); {summary.truncated} truncated, "
                   f"{summary.dropped} dropped")
    if fmt == "classification":
        mapping = summary.labels or {}
        names = mapping.get("label_names") or range(mapping.get("num_labels", 0))
        counts = ", ".join(f"{n}: {c}" for n, c in zip(names, mapping.get("label_counts", [])))
        pair = f" + {summary.outputs['text_pair']}" if "text_pair" in summary.outputs else ""
        click.echo(f"{summary.outputs['text']}{pair} + {summary.outputs['label']} (.bin/.idx): {summary.documents} "
                   f"examples ({summary.pairs} with a text_pair), {summary.tokens['text']} text tokens"
                   + (f", {summary.tokens['text_pair']} text_pair tokens" if pair else ""))
        click.echo(f"{mapping.get('num_labels', 0)} labels ({counts}) -> {config.output_prefix}_labels.json")
    if fmt == "seq2seq":
        click.echo(f"{summary.outputs['input']} + {summary.outputs['target']} (.bin/.idx): {summary.documents} "
                   f"examples, {summary.tokens['input']} input tokens, {summary.tokens['target']} target tokens")
    for key, prefix in ({} if fmt in ("sft", "classification", "seq2seq") else summary.outputs).items():
        empty = summary.empty_documents.get(key, 0)
        click.echo(f"{prefix}.bin/.idx: {summary.documents - empty} documents, {summary.tokens.get(key, 0)} tokens"
                   + (f", {empty} empty documents dropped" if empty else ""))
    click.echo(f"{summary.input_bytes / 1e6:.1f} MB in {summary.elapsed_s:.1f} s ({summary.mb_per_s:.2f} MB/s, "
               f"{summary.docs_per_s:.0f} docs/s); partitions {summary.partitions} "
               f"({summary.partitions_resumed} resumed)")
    if summary.bad_lines:
        click.echo(f"skipped {summary.bad_lines} bad lines, e.g. " + "; ".join(summary.bad_line_examples[:3]))
