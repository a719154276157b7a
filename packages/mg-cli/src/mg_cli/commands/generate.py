"""``mg generate``: continue a prompt (GPT) or answer a text-to-text prompt (T5) with an mg checkpoint or a
Hugging Face model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click


def _encoder_only(where: str, family: str) -> click.ClickException:
    return click.ClickException(f"{where} is a {family.upper()} model (encoder-only): it cannot generate text; "
                                f"use a GPT or T5 checkpoint")


def _load(checkpoint: str, precision: Any) -> tuple[Any, dict[str, Any], int | None]:
    """``(model, checkpoint state or {}, decoder start id if recorded)``, the model built in ``precision`` (an
    ``mg_parallel.Precision``); each file's metadata read once."""
    from mg_models.family import family_for_hf, get_family
    from mg_models.loading import checkpoint_family, is_mg_checkpoint, load_model, source_config

    if is_mg_checkpoint(checkpoint):
        config, extra = source_config(checkpoint)
        family = checkpoint_family(extra)
        if get_family(family).kind == "encoder":
            raise _encoder_only(checkpoint, family)
        model = load_model(checkpoint, config=config, precision=precision, inference=True).model
        start = extra.get("decoder_start_token_id")
        return model, extra, None if start is None else int(start)
    cfg_file = Path(checkpoint) / "config.json"
    hf_config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    fam = family_for_hf(hf_config["model_type"]) if "model_type" in hf_config else None
    if fam is not None and fam.kind == "encoder":
        raise _encoder_only(checkpoint, fam.name)
    start = fam.decoder_start_token_id(hf_config) if fam is not None else None
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{checkpoint} is neither a Hugging Face model directory (no config.json) nor an mg "
                                f"checkpoint")
    return load_model(checkpoint, precision=precision, inference=True).model, {}, start


@click.command("generate", context_settings={"show_default": True})
@click.option("--checkpoint", required=True,
              help="mg checkpoint (save directory or iter_NNNNNNN) or a Hugging Face model directory (GPT or T5).")
@click.option("--tokenizer-model", default=None,
              help="Tokenizer file (default: the one recorded in the mg checkpoint).")
@click.option("--prompt", "prompts", multiple=True, required=True,
              help="Prompt text (repeat for a batch); for T5, the source text.")
@click.option("--max-new-tokens", type=int, default=64)
@click.option("--temperature", type=float, default=0.0, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, help="0 = off.")
@click.option("--top-p", type=float, default=1.0, help="1.0 = off.")
@click.option("--seed", type=int, default=0, help="Sampling seed.")
@click.option("--stop-at-eod/--no-stop-at-eod", default=True, help="Stop a prompt at the end-of-document token.")
@click.option("--stop-token", "stop_tokens", multiple=True, metavar="TEXT",
              help="Also stop a prompt after this token, e.g. '<|im_end|>' (repeat for several); the text must "
                   "encode to exactly one token.")
@click.option("--json", "as_json", is_flag=True, help="Print token ids and per-token log-probabilities as JSON.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="train.precision=fp32|bf16|fp16: the parameters' precision (as mg train's key; default fp32).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="Alias of --set train.precision=DTYPE.")
def generate(checkpoint: str, tokenizer_model: str | None, prompts: tuple[str, ...], max_new_tokens: int,
             temperature: float, top_k: int, top_p: float, seed: int, stop_at_eod: bool,
             stop_tokens: tuple[str, ...], as_json: bool, sets: tuple[str, ...], dtype: str | None) -> None:
    """Generate text from PROMPTs with a KV cache.

    GPT models continue the prompt. T5 models encode the prompt and decode a new text from the
    decoder start token (text-to-text). BERT models are encoder-only and cannot generate.

    \b
    Examples:
      mg generate --checkpoint runs/demo/checkpoints --prompt "def main("
      mg generate --checkpoint ckpt --prompt "import os" --temperature 0.8 --top-p 0.9 --json
      mg generate --checkpoint ckpt --prompt "def main(" --set train.precision=bf16
      mg generate --checkpoint t5-ckpt --prompt "translate English to German: hello" --json
      mg generate --checkpoint sft-ckpt --prompt $'<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n' \\
                  --stop-token '<|im_end|>'
    """
    from mg_cli.commands.eval import precision_and_rest

    name, others = precision_and_rest(sets, dtype)
    if others:
        keys = ", ".join(dict.fromkeys(s.partition("=")[0] for s in others))
        raise click.ClickException(f"--set {keys}: mg generate takes only --set train.precision=fp32|bf16|fp16")
    from mg_ckpt import CheckpointError
    from mg_cli.training.families import pad_id
    from mg_data import build_tokenizer
    from mg_models import SamplingConfig, generate_seq2seq
    from mg_models import generate as run_generate
    from mg_models.family import family_of
    from mg_parallel.precision import Precision

    try:
        model, extra, start_id = _load(checkpoint, Precision.from_name(name))
        tokenizer_model = tokenizer_model or extra.get("tokenizer_model")
        if tokenizer_model is None:
            raise click.ClickException("--tokenizer-model is required (the checkpoint records none)")
        tok = build_tokenizer(tokenizer_model)
        ids = [tok.encode(p) for p in prompts]
        if any(len(i) == 0 for i in ids):
            raise click.ClickException("a prompt encodes to no tokens; give some text")
        stop_ids = [tok.eod] if stop_at_eod and tok.eod is not None else []
        for text in stop_tokens:
            piece = tok.encode(text)
            if len(piece) != 1:
                raise click.ClickException(f"--stop-token {text!r} encodes to {len(piece)} tokens {piece} with "
                                           f"{tokenizer_model}, not one; give a single token of the tokenizer "
                                           f"(e.g. a symbol it was trained with: mg tokenizer train "
                                           f"--user-defined-symbols)")
            stop_ids.append(piece[0])
        sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                  top_p=top_p, seed=seed, stop_token_ids=tuple(stop_ids))
        seq2seq = family_of(model.config).kind == "encoder-decoder"
        if seq2seq:
            # mg train starts T5 targets with the padding token (Hugging Face's convention too, where it is 0).
            start_id = start_id if start_id is not None else pad_id(tok)
            if start_id is None:
                raise click.ClickException(f"{checkpoint} records no decoder start token and the tokenizer has no "
                                           f"padding token; pass the tokenizer the model was trained with")
            out = generate_seq2seq(model, ids, sampling, decoder_start_token_id=start_id)
        else:
            out = run_generate(model, ids, sampling)
    except click.ClickException:
        raise
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e).splitlines()[0]) from None
    except CheckpointError as e:  # a corrupt or unreadable checkpoint: one line naming the file, not a traceback
        raise click.ClickException(str(e).splitlines()[0]) from None
    if as_json:
        click.echo(json.dumps([
            {"prompt": p, "prompt_ids": i, "generated_ids": t, "logprobs": lp, "text": tok.decode(t)}
            for p, i, t, lp in zip(prompts, ids, out.tokens, out.logprobs)
        ]))
        return
    for p, t in zip(prompts, out.tokens):
        text = tok.decode([x for x in t if x != tok.eod])
        click.echo(text if seq2seq else p + text)
