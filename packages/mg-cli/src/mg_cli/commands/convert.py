"""``mg convert``: Hugging Face model directories to mg checkpoints and back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "generation_config.json")


@click.command("convert", context_settings={"show_default": True})
@click.option("--from", "source", type=click.Choice(["hf", "mg"]), default=None, help="Input format.")
@click.option("--to", "target", type=click.Choice(["hf", "mg"]), default=None, help="Output format.")
@click.option("--input", "input_path", required=True, type=click.Path(path_type=Path),
              help="Hugging Face directory or mg checkpoint (save directory or iter_NNNNNNN).")
@click.option("--output", "output_path", required=True, type=click.Path(path_type=Path),
              help="Directory to write (mg: a save directory; hf: a model directory).")
@click.option("--tp", type=int, default=1, help="Intended tensor-parallel size (recorded; any layout can load it).")
@click.option("--pp", type=int, default=1, help="Intended pipeline-parallel size (recorded; any layout can load it).")
@click.option("--model-type", type=click.Choice(["gpt2", "llama", "mistral"]), default=None,
              help="Hugging Face architecture to export (default: the one recorded, else llama/gpt2 by shape).")
@click.option("--max-shard-gb", type=float, default=5.0, help="Largest Hugging Face shard file, GB.")
@click.option("--tokenizer-dir", type=click.Path(path_type=Path), default=None,
              help="Copy tokenizer files from this directory into the Hugging Face output.")
def convert(source: str | None, target: str | None, input_path: Path, output_path: Path, tp: int, pp: int,
            model_type: str | None, max_shard_gb: float, tokenizer_dir: Path | None) -> None:
    """Convert between Hugging Face (GPT-2, Llama, Mistral) and mg checkpoints.

    mg checkpoints store global tensors, so one converted checkpoint loads at any tp/pp/dp.

    \b
    Examples:
      mg convert --from hf --input ./llama-hf --output ./ckpt --tp 2
      mg convert --to hf --input ./ckpt --output ./export --tokenizer-dir ./llama-hf
    """
    from mg_cli.checkpoints import is_mg_checkpoint

    if source is None:
        source = "mg" if is_mg_checkpoint(input_path) else "hf"
    if target is None:
        target = "hf" if source == "mg" else "mg"
    if source == target:
        raise click.ClickException(f"--from {source} --to {target}: nothing to convert")
    try:
        if source == "hf":
            _hf_to_mg(input_path, output_path, tp, pp)
        else:
            _mg_to_hf(input_path, output_path, model_type, int(max_shard_gb * 1e9), tokenizer_dir)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e).splitlines()[0]) from None
    except Exception as e:
        if type(e).__name__ == "CheckpointError":
            raise click.ClickException(str(e).splitlines()[0]) from None
        raise


def _hf_to_mg(src: Path, out: Path, tp: int, pp: int) -> None:
    from mg_ckpt import save_checkpoint
    from mg_models.config import check_parallel
    from mg_models.hf import read_hf_directory

    config, state, model_type = read_hf_directory(src)
    check_parallel(config, tp, pp)
    extra = {"iteration": 0, "model_config": config.to_dict(), "hf_model_type": model_type,
             "source": str(src.resolve())}
    for name in _TOKENIZER_FILES:
        if (src / name).exists() and name in ("tokenizer.model", "tokenizer.json"):
            extra["tokenizer_model"] = str((src / name).resolve())
            break
    save_checkpoint(str(out), 0, {f"model/{k}": v for k, v in state.items()},
                    extra=extra, layout={"tp": tp, "pp": pp, "converted_from": "hf"})
    click.echo(f"wrote {out}/iter_0000000 ({len(state)} tensors, {model_type}); load it at any layout")


def _mg_to_hf(src: Path, out: Path, model_type: str | None, max_shard_bytes: int, tokenizer_dir: Path | None) -> None:
    from mg_ckpt import write_hf_safetensors
    from mg_cli.checkpoints import read_mg_checkpoint
    from mg_models.hf import SUPPORTED_MODEL_TYPES, state_to_hf

    config, state, extra = read_mg_checkpoint(src)
    model_type = model_type or extra.get("hf_model_type") or (
        "gpt2" if config.position_embedding == "learned" else "llama")
    adapter = SUPPORTED_MODEL_TYPES[model_type]
    hf_config = adapter.config_to_hf(config) if model_type == "gpt2" else adapter.config_to_hf(config, model_type)
    tensors = state_to_hf(state, config, model_type)
    del state
    out.mkdir(parents=True, exist_ok=True)
    write_hf_safetensors(str(out), ((k, v.contiguous()) for k, v in tensors.items()), max_shard_bytes)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if tokenizer_dir is not None:
        for name in _TOKENIZER_FILES:
            if (tokenizer_dir / name).exists():
                shutil.copy2(tokenizer_dir / name, out / name)
    click.echo(f"wrote {out} ({model_type}, {len(tensors)} tensors)")
