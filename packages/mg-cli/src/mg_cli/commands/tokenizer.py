"""``mg tokenizer``: train and try tokenizers."""

from __future__ import annotations

import click


@click.group("tokenizer")
def tokenizer() -> None:
    """Train a SentencePiece tokenizer on JSONL text, or encode text with one."""


@tokenizer.command("train", context_settings={"show_default": True})
@click.option("--input", "inputs", multiple=True, required=True, help="JSONL input files (repeatable).")
@click.option("--output-prefix", required=True, help="Writes PREFIX.model and PREFIX.vocab.")
@click.option("--vocab-size", type=int, default=8000)
@click.option("--model-type", type=click.Choice(["bpe", "unigram", "char", "word"]), default="bpe")
@click.option("--json-keys", default="text", help="Comma-separated JSON keys holding text.")
@click.option("--byte-fallback/--no-byte-fallback", default=True,
              help="Encode unknown characters as bytes (exact decoding needs it).")
@click.option("--max-lines", type=int, default=1_000_000,
              help="About this many lines are sampled for training.")
@click.option("--threads", type=int, default=2)
@click.option("--user-defined-symbols", default="",
              help="Comma-separated extra symbols with their own ids, e.g. <pad>,<cls>,<sep>,<mask> for BERT, "
                   "<pad> for T5.")
@click.option("--extra-ids", type=int, default=0,
              help="Add the T5 sentinels <extra_id_0> .. <extra_id_{N-1}> as symbols (T5 uses 100).")
@click.option("--pad-id", type=int, default=-1, help="Id of a padding piece (-1: none).")
@click.option("--exact-whitespace/--line-by-line", default=True,
              help="Train on whole documents keeping newlines, tabs and runs of spaces, so decoding "
                   "gives the text back exactly; --line-by-line: the former training on stripped, "
                   "normalised lines.")
def train(inputs: tuple[str, ...], output_prefix: str, vocab_size: int, model_type: str, json_keys: str,
          byte_fallback: bool, max_lines: int, threads: int, user_defined_symbols: str, extra_ids: int,
          pad_id: int, exact_whitespace: bool) -> None:
    """Train a SentencePiece model (ids: unk 0, bos 1, eos 2 = end of document).

    By default the model keeps text as written (line breaks, indentation, no Unicode
    normalisation): decode(encode(text)) == text, which generated code needs to run.

    \b
    Example:
      mg tokenizer train --input corpus.jsonl --output-prefix tok --vocab-size 8000
      mg tokenizer train ... --user-defined-symbols '<pad>,<cls>,<sep>,<mask>'     # for BERT
      mg tokenizer train ... --user-defined-symbols '<pad>' --extra-ids 100      # for T5
    """
    from mg_data import train_sentencepiece

    if extra_ids < 0:
        raise click.ClickException(f"--extra-ids must be >= 0, got {extra_ids}")
    symbols = [x.strip() for x in user_defined_symbols.split(",") if x.strip()]
    symbols += [f"<extra_id_{k}>" for k in range(extra_ids) if f"<extra_id_{k}>" not in symbols]
    try:
        path = train_sentencepiece(
            list(inputs), output_prefix, vocab_size=vocab_size, model_type=model_type,
            json_keys=[k.strip() for k in json_keys.split(",") if k.strip()], byte_fallback=byte_fallback,
            input_sentence_size=max_lines, num_threads=threads, pad_id=pad_id,
            user_defined_symbols=symbols, exact_whitespace=exact_whitespace,
        )
    except (ValueError, OSError, RuntimeError) as e:
        raise click.ClickException(str(e).splitlines()[0]) from None
    click.echo(path)


@tokenizer.command("encode")
@click.option("--tokenizer-model", required=True, help="Tokenizer file.")
@click.argument("text")
def encode(tokenizer_model: str, text: str) -> None:
    """Print the token ids of TEXT (and the round-trip decode)."""
    from mg_data import build_tokenizer

    try:
        tok = build_tokenizer(tokenizer_model)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e).splitlines()[0]) from None
    ids = tok.encode(text)
    click.echo(" ".join(map(str, ids)))
    click.echo(tok.decode(ids))
