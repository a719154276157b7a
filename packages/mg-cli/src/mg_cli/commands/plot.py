"""``mg plot LOGDIR``: loss, validation loss, throughput and MoE load-balance curves from metrics.jsonl as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import click


def read_metrics(path: Path) -> list[dict]:
    """Parse ``metrics.jsonl`` (one JSON object per line); a torn last line is ignored.

    Raises:
        click.ClickException: the file is missing or a line other than the last is not JSON.
    """
    if not path.is_file():
        raise click.ClickException(f"{path} does not exist; pass the log.dir of a run (it holds metrics.jsonl)")
    rows = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines):  # a run killed mid-write: everything before it is intact
                break
            raise click.ClickException(f"{path} line {i} is not valid JSON") from None
    return rows


def moe_layers(rows: list[dict]) -> list[int]:
    """The MoE layers whose expert load ``metrics.jsonl`` records (``moe_load/<layer>/max``), in order."""
    return sorted({int(k.split("/")[1]) for r in rows for k in r if k.startswith("moe_load/") and k.endswith("/max")})


def plot_metrics(rows: list[dict], out: Path, title: str = "") -> Path:
    """Draw loss (train and validation), tokens/s, the ``eval/<task>/<metric>`` values of ``eval.tasks`` and, for a
    mixture of experts, each MoE layer's expert load (the most and least loaded expert's tokens as a multiple of
    the mean) against iteration into ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if "loss" in r and "iteration" in r]
    val = [r for r in rows if "val_loss" in r and "iteration" in r]
    # eval.tasks metrics (perplexity left out: nll_per_token carries it on a scale the others share)
    tasks = sorted({k for r in rows for k in r if k.startswith("eval/") and not k.endswith("/perplexity")})
    layers = moe_layers(rows)
    n = 2 + bool(tasks) + bool(layers)
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4))
    ax_loss, ax_tps = axes[0], axes[1]
    if tasks:
        for key in tasks:
            points = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None and "iteration" in r]
            axes[2].plot(*zip(*points), "o-", label=key.removeprefix("eval/"), lw=1)
        axes[2].set_xlabel("iteration")
        axes[2].set_ylabel("eval.tasks metrics")
        axes[2].legend(fontsize="small")
        axes[2].grid(alpha=0.3)
    if layers:
        ax = axes[-1]
        for i, layer in enumerate(layers):
            color = f"C{i % 10}"
            for end, style in (("max", "-"), ("min", "--")):
                points = [(r["iteration"], r[f"moe_load/{layer}/{end}"]) for r in train if f"moe_load/{layer}/{end}" in r]
                ax.plot(*zip(*points), style, color=color, lw=1, label=f"layer {layer} {end}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("iteration")
        ax.set_ylabel("expert load / mean (max solid, min dashed)")
        ax.legend(fontsize="x-small", ncol=2)
        ax.grid(alpha=0.3)
    if train:
        ax_loss.plot([r["iteration"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    if val:
        ax_loss.plot([r["iteration"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax_loss.set_xlabel("iteration")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    tps = [r for r in train if r.get("tokens_per_s")]
    if tps:
        ax_tps.plot([r["iteration"] for r in tps], [r["tokens_per_s"] for r in tps], lw=1, color="tab:green")
    ax_tps.set_xlabel("iteration")
    ax_tps.set_ylabel("tokens/s")
    ax_tps.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


@click.command("plot")
@click.argument("logdir", type=click.Path(path_type=Path))
@click.option("--output", "-o", type=click.Path(path_type=Path), default=None,
              help="PNG to write (default: LOGDIR/curves.png).")
def plot(logdir: Path, output: Path | None) -> None:
    """Render loss / validation loss / throughput curves of a run to a PNG.

    \b
    Example:
      mg plot runs/demo            # writes runs/demo/curves.png
    """
    rows = read_metrics(logdir / "metrics.jsonl")
    if not rows:
        raise click.ClickException(f"{logdir / 'metrics.jsonl'} holds no logged iterations yet")
    out = plot_metrics(rows, output or logdir / "curves.png", title=str(logdir))
    click.echo(str(out))
