"""Draw an executed pipeline schedule (time on x, pipeline stage on y) as a PNG.

Runs the sleep-dominated pp=4 stages of ``bench_pipeline.py`` with a ``ScheduleRecorder`` on
every rank and draws each recorded forward (blue shades, one per model chunk) and backward
(orange shades) pass, labelled with its microbatch. The white gaps are the pipeline bubble.

Run from the repository root::

    .venv/bin/python benchmarks/plot_schedule.py --schedule interleaved --microbatches 8 --out schedule.png
"""

from __future__ import annotations

import argparse

from bench_pipeline import PP, pipeline_time


def draw(events: list, title: str, out: str) -> None:
    """Save a Gantt chart of ``events`` (``ScheduleEvent`` of every rank) to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(e.t_start for e in events)
    fwd = ["#1f77b4", "#6baed6", "#08519c", "#9ecae1"]
    bwd = ["#ff7f0e", "#fdae6b", "#a63603", "#fdd0a2"]
    fig, ax = plt.subplots(figsize=(12, 0.7 * PP + 1.2))
    for e in events:
        colour = (fwd if e.kind == "F" else bwd)[e.chunk % 4]
        start, width = (e.t_start - t0) * 1000, (e.t_end - e.t_start) * 1000
        ax.barh(e.pp_rank, width, left=start, height=0.8, color=colour, edgecolor="black", linewidth=0.4)
        ax.text(start + width / 2, e.pp_rank, str(e.microbatch), ha="center", va="center", fontsize=7)
    from matplotlib.patches import Patch

    chunks = sorted({e.chunk for e in events})
    handles = [Patch(color=fwd[c % 4], label=f"forward, chunk {c}") for c in chunks]
    handles += [Patch(color=bwd[c % 4], label=f"backward, chunk {c}") for c in chunks]
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=2)
    ax.set_yticks(range(PP), [f"stage {r}" for r in range(PP)])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedule", choices=["1f1b", "interleaved"], default="1f1b")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--stage-ms", type=float, default=50.0)
    parser.add_argument("--out", default="pipeline_schedule.png")
    args = parser.parse_args()
    vpp = 2 if args.schedule == "interleaved" else 1
    t, events = pipeline_time(vpp, args.microbatches, args.stage_ms / 1000, iters=1)
    title = f"{args.schedule}, pp={PP}, v={vpp}, m={args.microbatches}: {t * 1000:.0f} ms per iteration"
    draw(events, title, args.out)
    print(f"wrote {args.out} ({title})")


if __name__ == "__main__":
    main()
