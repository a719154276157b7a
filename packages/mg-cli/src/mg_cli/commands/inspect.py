"""``mg inspect PATH``: describe and verify a dataset prefix or a checkpoint."""

from __future__ import annotations

import json
import os

import click


def _is_data_prefix(path: str) -> bool:
    return os.path.isfile(path + ".idx") or os.path.isfile(path + ".bin")


@click.command("inspect")
@click.argument("path")
@click.option("--no-verify", is_flag=True, help="Skip checksum / consistency verification.")
@click.option("--all-tensors", is_flag=True, help="List every tensor of a checkpoint (default: the first 50).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def inspect(path: str, no_verify: bool, all_tensors: bool, as_json: bool) -> None:
    """Describe and verify PATH: a dataset prefix (PATH.bin/.idx), a checkpoint save directory
    (its latest checkpoint) or one iter_NNNNNNN directory. Exits 1 naming the bad file when
    verification fails.

    \b
    Examples:
      mg inspect data/corpus_text_document
      mg inspect checkpoints/run1
      mg inspect checkpoints/run1/iter_0000200
    """
    if _is_data_prefix(path):
        from mg_data import IndexedDataset, IndexedDatasetError

        try:
            ds = IndexedDataset(path)
            if not no_verify:
                ds.verify()
            info = ds.summary()
        except (IndexedDatasetError, OSError, ValueError) as e:
            raise click.ClickException(str(e)) from None
        info["verified"] = not no_verify
        if as_json:
            click.echo(json.dumps(info, default=str))
        else:
            click.echo(f"dataset {path}")
            for k, v in info.items():
                click.echo(f"  {k}: {v}")
        return
    if not os.path.isdir(path):
        raise click.ClickException(
            f"{path} is neither a dataset prefix ({path}.bin/.idx) nor a checkpoint directory"
        )
    from mg_ckpt import CheckpointError, inspect_checkpoint

    try:
        report = inspect_checkpoint(path, verify=not no_verify)
    except (CheckpointError, OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    # Checkpoints written by mg train / mg convert record the model; others (any mg-ckpt user) need not.
    family = report.state.get("model_family", "gpt") if "model_config" in report.state else None
    if as_json:
        click.echo(json.dumps({
            "path": report.path, "iteration": report.iteration, "layout": report.layout,
            "verified": report.verified, "total_bytes": report.total_bytes, "model_family": family,
            "tensors": {t.name: {"shape": list(t.shape), "dtype": t.dtype} for t in report.tensors},
        }))
    else:
        click.echo(report.format(max_tensors=None if all_tensors else 50))
        if family is not None:
            source = report.state.get("hf_model_type")
            click.echo(f"  model family {family}" + (f" (converted from Hugging Face {source})" if source else ""))
