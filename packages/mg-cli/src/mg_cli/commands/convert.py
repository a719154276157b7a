"""``mg convert``: Hugging Face model directories to mg checkpoints and back, one tensor group at a time.

Neither direction holds the model in memory: the tensors' shapes are planned from the source's
headers first (the conversions run on ``meta`` tensors), then each small group of tensors (one
tensor, or a layer's q/k/v) is read, converted and written straight to its output file before
the next is read. A model larger than the machine's memory converts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import click

from mg_models.family import families, get_family

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "generation_config.json", "spiece.model", "vocab.txt")
HF_TYPES = tuple(t for f in families().values() for t in f.hf_model_types)
"""Every Hugging Face model type an installed family converts (the families load without torch, so --help stays
instant)."""
# Token ids of config.json kept through an import and restored on export.
_TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


@click.command("convert", context_settings={"show_default": True})
@click.option("--from", "source", type=click.Choice(["hf", "mg"]), default=None, help="Input format.")
@click.option("--to", "target", type=click.Choice(["hf", "mg"]), default=None, help="Output format.")
@click.option("--input", "input_path", required=True, type=click.Path(path_type=Path),
              help="Hugging Face directory or mg checkpoint (save directory or iter_NNNNNNN).")
@click.option("--output", "output_path", required=True, type=click.Path(path_type=Path),
              help="Directory to write (mg: a save directory; hf: a model directory).")
@click.option("--tp", type=int, default=1, help="Intended tensor-parallel size (recorded; any layout can load it).")
@click.option("--pp", type=int, default=1, help="Intended pipeline-parallel size (recorded; any layout can load it).")
@click.option("--model-type", type=click.Choice(HF_TYPES), default=None,
              help="Hugging Face architecture to export (default: the one recorded, else by family and shape).")
@click.option("--max-shard-gb", type=float, default=5.0, help="Largest output shard file, GB.")
@click.option("--tokenizer-dir", type=click.Path(path_type=Path), default=None,
              help="Copy tokenizer files from this directory into the Hugging Face output.")
def convert(source: str | None, target: str | None, input_path: Path, output_path: Path, tp: int, pp: int,
            model_type: str | None, max_shard_gb: float, tokenizer_dir: Path | None) -> None:
    """Convert between Hugging Face (GPT-2, Llama, Mistral, BERT, T5) and mg checkpoints.

    mg checkpoints store global tensors, so one converted checkpoint loads at any tp/pp/dp.
    Conversion streams: memory holds one tensor (or one layer's q/k/v) at a time.

    \b
    Examples:
      mg convert --from hf --input ./llama-hf --output ./ckpt --tp 2
      mg convert --to hf --input ./ckpt --output ./export --tokenizer-dir ./llama-hf
      mg convert --from hf --input ./t5-small-hf --output ./t5-ckpt
    """
    from mg_models.loading import is_mg_checkpoint

    if source is None:
        source = "mg" if is_mg_checkpoint(input_path) else "hf"
    if target is None:
        target = "hf" if source == "mg" else "mg"
    if source == target:
        raise click.ClickException(f"--from {source} --to {target}: nothing to convert")
    if max_shard_gb <= 0:
        raise click.ClickException(f"--max-shard-gb={max_shard_gb} must be > 0")
    max_shard_bytes = max(1, int(max_shard_gb * 1e9))
    from mg_ckpt import CheckpointError

    try:
        if source == "hf":
            _hf_to_mg(input_path, output_path, tp, pp, max_shard_bytes)
        else:
            _mg_to_hf(input_path, output_path, model_type, max_shard_bytes, tokenizer_dir)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e).splitlines()[0]) from None
    except CheckpointError as e:  # a corrupt or unreadable checkpoint: one line naming the file, not a traceback
        raise click.ClickException(str(e).splitlines()[0]) from None


def _check_layout(config: Any, tp: int, pp: int) -> None:
    from mg_models.config import check_parallel

    try:
        check_parallel(config, tp, pp)
    except ValueError as e:
        raise ValueError(f"--tp {tp} --pp {pp}: {e}") from None


def _hf_to_mg(src: Path, out: Path, tp: int, pp: int, max_shard_bytes: int) -> None:
    from mg_ckpt import HFSafetensorsReader, StreamingCheckpointWriter
    from mg_models.hf import (
        converted_specs,
        hf_model_types,
        hf_tensor_ignored,
        iter_converted,
        read_hf_config,
        tensor_groups,
    )
    from mg_models.loading import MODEL_PREFIX

    if not (src / "config.json").exists():
        raise FileNotFoundError(f"{src / 'config.json'} not found; --input must be a Hugging Face model directory "
                                f"or an mg checkpoint")
    reader = HFSafetensorsReader(str(src))
    config, model_type = read_hf_config(src, reader.weight_map, reader.read)
    family = hf_model_types()[model_type]
    _check_layout(config, tp, pp)
    groups = tensor_groups(config, model_type)
    needed = [n for g in groups for n in g.hf]
    missing = [n for n in needed if n not in reader.weight_map]
    if missing:
        raise ValueError(f"{src}: checkpoint is missing tensor {missing[0]!r} required by its config.json")
    known = set(needed)
    unknown = sorted(n for n in reader.weight_map if n not in known and not hf_tensor_ignored(n, config, model_type))
    if unknown:
        raise ValueError(f"{src}: checkpoint holds tensors mg does not know: {unknown[:5]}")
    specs = converted_specs(groups, reader.spec, "mg")
    extra = {"iteration": 0, "model_family": family, "model_config": config.to_dict(), "hf_model_type": model_type,
             "source": str(src.resolve())}
    hf_config = json.loads((src / "config.json").read_text())
    extra["hf_token_ids"] = {k: hf_config[k] for k in _TOKEN_ID_KEYS if k in hf_config}
    extra.update(get_family(family).hf_import_extra(hf_config))  # e.g. T5's decoder start id
    for name in ("tokenizer.model", "spiece.model", "tokenizer.json"):
        if (src / name).exists():
            extra["tokenizer_model"] = str((src / name).resolve())
            break
    with StreamingCheckpointWriter(str(out), 0, [(MODEL_PREFIX + n, s, d) for n, s, d in specs], extra=extra,
                                   layout={"tp": tp, "pp": pp, "converted_from": "hf"},
                                   max_shard_bytes=max_shard_bytes) as writer:
        for name, tensor in iter_converted(groups, lambda names: {n: reader.read(n) for n in names}, "mg"):
            writer.write(MODEL_PREFIX + name, tensor)
            del tensor
    click.echo(f"wrote {writer.path} ({len(specs)} tensors, {model_type}); load it at any layout")


def _labels(extra: dict[str, Any]) -> dict[str, Any]:
    """config.json's id2label/label2id from the label names a classification run recorded (none for int labels)."""
    names = extra.get("label_names")
    if not names:
        return {}
    return {"id2label": {str(i): n for i, n in enumerate(names)}, "label2id": {n: i for i, n in enumerate(names)}}


def _token_ids(extra: dict[str, Any], model_type: str, config: Any, family: Any) -> dict[str, Any]:
    """config.json token ids: those recorded at import, else those the family takes from the tokenizer mg training
    used (T5's pad, decoder start and eod; a GPT classifier's padding)."""
    if "hf_token_ids" in extra:
        return dict(extra["hf_token_ids"])
    if not extra.get("tokenizer_model"):
        return {}
    from mg_data import build_tokenizer
    from mg_models.family import TokenLookup

    try:
        tok = build_tokenizer(extra["tokenizer_model"])
    except (OSError, ValueError):
        return {}  # the recorded tokenizer moved: keep the adapter's defaults
    return family.hf_token_ids(config, model_type, TokenLookup(tok))


def _mg_to_hf(src: Path, out: Path, model_type: str | None, max_shard_bytes: int, tokenizer_dir: Path | None) -> None:
    from mg_ckpt import CheckpointError, CheckpointReader, write_hf_safetensors
    from mg_models.hf import config_to_hf, converted_specs, iter_converted, tensor_groups
    from mg_models.loading import MODEL_PREFIX, checkpoint_config, checkpoint_family

    reader = CheckpointReader(str(src), verify=True)  # every file's checksum, once, before converting
    extra = reader.extra
    config = checkpoint_config(extra, reader.path)
    family = get_family(checkpoint_family(extra))
    model_type = family.hf_export_type(config, model_type, extra.get("hf_model_type"))
    hf_config = config_to_hf(config, model_type)
    hf_config.update(_token_ids(extra, model_type, config, family))
    hf_config.update(_labels(extra))
    groups = tensor_groups(config, model_type)
    missing = [n for g in groups for n in g.mg if MODEL_PREFIX + n not in reader.specs]
    if missing:
        raise CheckpointError(f"{reader.path}: tensor {MODEL_PREFIX + missing[0]!r} needed for the {model_type} "
                              f"export is not in the checkpoint")
    specs = converted_specs(groups, lambda n: reader.specs[MODEL_PREFIX + n], "hf")

    def read(names: list[str]) -> dict[str, Any]:
        got = reader.read([MODEL_PREFIX + n for n in names])
        return {n: got[MODEL_PREFIX + n] for n in names}

    out.mkdir(parents=True, exist_ok=True)
    write_hf_safetensors(str(out), iter_converted(groups, read, "hf"), max_shard_bytes, specs=specs)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if tokenizer_dir is not None:
        for name in _TOKENIZER_FILES:
            if (tokenizer_dir / name).exists():
                shutil.copy2(tokenizer_dir / name, out / name)
    click.echo(f"wrote {out} ({model_type}, {len(specs)} tensors)")
