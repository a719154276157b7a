"""``mg generate``: continue a prompt with a trained checkpoint or a Hugging Face model."""

from __future__ import annotations

import json

import click


@click.command("generate", context_settings={"show_default": True})
@click.option("--checkpoint", required=True,
              help="mg checkpoint (save directory or iter_NNNNNNN) or a Hugging Face model directory.")
@click.option("--tokenizer-model", default=None,
              help="Tokenizer file (default: the one recorded in the mg checkpoint).")
@click.option("--prompt", "prompts", multiple=True, required=True, help="Prompt text (repeat for a batch).")
@click.option("--max-new-tokens", type=int, default=64)
@click.option("--temperature", type=float, default=0.0, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, help="0 = off.")
@click.option("--top-p", type=float, default=1.0, help="1.0 = off.")
@click.option("--seed", type=int, default=0, help="Sampling seed.")
@click.option("--stop-at-eod/--no-stop-at-eod", default=True, help="Stop a prompt at the end-of-document token.")
@click.option("--json", "as_json", is_flag=True, help="Print token ids and per-token log-probabilities as JSON.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32")
def generate(checkpoint: str, tokenizer_model: str | None, prompts: tuple[str, ...], max_new_tokens: int,
             temperature: float, top_k: int, top_p: float, seed: int, stop_at_eod: bool, as_json: bool,
             dtype: str) -> None:
    """Generate text from PROMPTs with a KV cache.

    \b
    Examples:
      mg generate --checkpoint runs/demo/checkpoints --prompt "def main("
      mg generate --checkpoint ckpt --prompt "import os" --temperature 0.8 --top-p 0.9 --json
    """
    import torch

    from mg_cli.checkpoints import is_mg_checkpoint, read_mg_checkpoint, register
    from mg_data import build_tokenizer
    from mg_models import SamplingConfig, load_pretrained
    from mg_models import generate as run_generate

    register()
    try:
        if tokenizer_model is None and is_mg_checkpoint(checkpoint):
            _, _, extra = read_mg_checkpoint(checkpoint, with_state=False)
            tokenizer_model = extra.get("tokenizer_model")
        if tokenizer_model is None:
            raise click.ClickException("--tokenizer-model is required (the checkpoint records none)")
        tok = build_tokenizer(tokenizer_model)
        model = load_pretrained(checkpoint, dtype=torch.bfloat16 if dtype == "bf16" else None)
        ids = [tok.encode(p) for p in prompts]
        if any(len(i) == 0 for i in ids):
            raise click.ClickException("a prompt encodes to no tokens; give some text")
        sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                  top_p=top_p, seed=seed,
                                  stop_token_ids=(tok.eod,) if stop_at_eod and tok.eod is not None else ())
        out = run_generate(model, ids, sampling)
    except click.ClickException:
        raise
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e).splitlines()[0]) from None
    except Exception as e:  # mg_ckpt.CheckpointError and friends: one line, not a traceback
        if type(e).__name__ == "CheckpointError":
            raise click.ClickException(str(e).splitlines()[0]) from None
        raise
    if as_json:
        click.echo(json.dumps([
            {"prompt": p, "prompt_ids": i, "generated_ids": t, "logprobs": lp, "text": tok.decode(t)}
            for p, i, t, lp in zip(prompts, ids, out.tokens, out.logprobs)
        ]))
        return
    for p, t in zip(prompts, out.tokens):
        click.echo(p + tok.decode([x for x in t if x != tok.eod]))
