"""``mg eval``: perplexity, zero-shot, fine-tuned task and code metrics of a checkpoint, at any layout."""

from __future__ import annotations

import os
import sys

import click

from mg_cli.evaluation.tasks import KINDS

_KINDS_HELP = "\b\n" + "\n".join(f"  {k:<15}{v}" for k, v in KINDS.items())


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: write comma-separated integers, e.g. 1,10") from None


def _layout(sets: list[str]) -> dict[str, int]:
    out = {}
    for s in sets:
        key, sep, value = s.partition("=")
        if key not in ("parallel.tp", "parallel.pp") or not sep or not value.isdigit():
            raise click.ClickException(f"--set {s}: mg eval takes parallel.tp=N, parallel.pp=N "
                                       f"(dp is processes / (tp * pp)) and train.precision=fp32|bf16|fp16")
        out[key.split(".")[1]] = int(value)
    return out


def precision_and_rest(sets: tuple[str, ...], dtype: str | None, *, note: bool = True) -> tuple[str, list[str]]:
    """``--set train.precision`` (or its alias ``--dtype``, noted on stderr when ``note``) and the other ``--set``
    strings; a bad value or a disagreement is a one-line error."""
    from mg_cli.config import ConfigError
    from mg_cli.evaluation.options import PRECISION_KEY, inference_precision

    try:
        precision, rest = inference_precision(sets, dtype)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    if dtype is not None and note:
        click.echo(f"note: --dtype is an alias of --set {PRECISION_KEY}={dtype}", err=True)
    return precision, rest


@click.command("eval", context_settings={"show_default": True},
               epilog="Task kinds (--task KIND:PATH, or NAME=KIND:PATH):\n\n" + _KINDS_HELP)
@click.option("--checkpoint", required=True, help="mg checkpoint (any layout) or Hugging Face model directory.")
@click.option("--task", "tasks", multiple=True, help="KIND:PATH (repeat for several tasks).")
@click.option("--harness-task", "harness_tasks", multiple=True,
              help="lm-evaluation-harness task, group or tag name, or task/group YAML file (needs mg-cli[eval]).")
@click.option("--tokenizer-model", default=None, help="Tokenizer file (default: the checkpoint's; byte: UTF-8 bytes).")
@click.option("--limit", type=int, default=None, help="Evaluate only the first K examples of each task.")
@click.option("--batch-size", type=int, default=8, help="Sequences per forward pass (per data-parallel rank).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every metric, its standard error, counts, checkpoint, layout and config here.")
@click.option("--stride", type=int, default=None, help="Perplexity: tokens per window after the first "
              "(default: the context length, i.e. non-overlapping windows).")
@click.option("--max-length", type=int, default=None, help="Context length (default: the model's positions).")
@click.option("--target-delimiter", default=" ", help="Multiple choice: text between context and choice.")
@click.option("--max-new-tokens", type=int, default=64, help="Generation tasks: tokens generated at most.")
@click.option("--until", multiple=True, help="Generation tasks: cut a generation at this string (repeat; "
              "default: newline for GPT seq2seq, the next top-level statement for humaneval).")
@click.option("--chat-template", default="chatml", help="SFT loss: chat template (chatml, auto, or a Jinja file).")
@click.option("--num-samples", type=int, default=1, help="Humaneval: programs per problem (n of pass@k).")
@click.option("--pass-k", default="1", help="Humaneval: comma-separated k of pass@k.")
@click.option("--temperature", type=float, default=0.0, help="Humaneval: sampling temperature (0 = greedy).")
@click.option("--seed", type=int, default=0, help="Sampling seed.")
@click.option("--timeout", "timeout_s", type=float, default=10.0, help="Humaneval: seconds per program.")
@click.option("--allow-code-execution", is_flag=True, help="Run untrusted code: humaneval's generated programs, "
              "and the Python a harness task YAML names (!function, unsafe_code).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="Alias of --set train.precision=DTYPE.")
@click.option("--set", "sets", multiple=True, help="Layout: parallel.tp=N, parallel.pp=N; parameters' precision: "
              "train.precision=fp32|bf16|fp16 (as mg train's key; default fp32).")
@click.option("--nproc-per-node", type=int, default=1, help="Processes to start (torch.distributed.run).")
def eval_command(checkpoint: str, tasks: tuple[str, ...], harness_tasks: tuple[str, ...],
                 tokenizer_model: str | None, limit: int | None, batch_size: int, json_path: str | None,
                 stride: int | None, max_length: int | None, target_delimiter: str, max_new_tokens: int,
                 until: tuple[str, ...], chat_template: str, num_samples: int, pass_k: str, temperature: float,
                 seed: int, timeout_s: float, allow_code_execution: bool, dtype: str | None, sets: tuple[str, ...],
                 nproc_per_node: int) -> None:
    """Evaluate a checkpoint on tasks; print a results table and optionally write JSON.

    \b
    Examples:
      mg eval --checkpoint ckpt --task perplexity:valid.jsonl --task choice:hellaswag.jsonl --json out.json
      mg eval --checkpoint ckpt --task perplexity:data/corpus_text_document --limit 100 --stride 512
      mg eval --checkpoint hf_dir --task humaneval:HumanEval.jsonl --allow-code-execution
      mg eval --checkpoint ckpt --task cloze:lambada.jsonl --set parallel.tp=2 --nproc-per-node 2
      mg eval --checkpoint ckpt --task perplexity:valid.jsonl --set train.precision=bf16
      mg eval --checkpoint ckpt --harness-task my_task.yaml
    """
    from mg_cli import launch
    from mg_cli.evaluation.options import EvalOptions
    from mg_cli.evaluation.tasks import parse_task

    if not tasks and not harness_tasks:
        raise click.UsageError("give at least one --task KIND:PATH or --harness-task NAME")
    precision, layout_sets = precision_and_rest(sets, dtype, note=not launch.under_launcher())  # noted once
    layout = _layout(layout_sets)
    try:
        specs = [parse_task(t) for t in tasks]
        options = EvalOptions(limit=limit, stride=stride, target_delimiter=target_delimiter,
                              max_new_tokens=max_new_tokens, until=until or None, chat_template=chat_template,
                              num_samples=num_samples, pass_k=_ints(pass_k), temperature=temperature, seed=seed,
                              timeout_s=timeout_s, allow_code_execution=allow_code_execution)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if any(s.kind == "humaneval" for s in specs) and not allow_code_execution:
        from mg_cli.evaluation.execution import CodeExecutionRefused

        raise click.ClickException(str(CodeExecutionRefused(next(s.path for s in specs if s.kind == "humaneval"))))
    if harness_tasks and not launch.under_launcher():  # task files: once, before any process starts
        from mg_cli.evaluation.harness import check_harness_tasks

        try:
            check_harness_tasks(harness_tasks, allow_code_execution=allow_code_execution)
        except (ValueError, ImportError) as e:
            raise click.ClickException(str(e)) from None
    if nproc_per_node > 1 and not launch.under_launcher():
        argv = sys.argv[sys.argv.index("eval"):] if "eval" in sys.argv else None
        if argv is None:
            raise click.ClickException("--nproc-per-node needs mg eval run as a command (mg eval ...)")
        sys.exit(launch.relaunch(argv, nproc_per_node=nproc_per_node, nnodes=1, node_rank=0,
                                 master_addr=None, master_port=None))
    launch.adopt_slurm_env()
    _run(checkpoint, specs, options, harness_tasks, layout, batch_size, tokenizer_model, precision, max_length,
         json_path)


def _run(checkpoint: str, specs: list, options: object, harness_tasks: tuple[str, ...], layout: dict[str, int],
         batch_size: int, tokenizer_model: str | None, precision: str, max_length: int | None,
         json_path: str | None) -> None:
    from mg_ckpt import CheckpointError
    from mg_cli.evaluation.report import format_table, write_json
    from mg_cli.evaluation.run import Layout, run_eval
    from mg_cli.job import JobEnvError

    try:
        report = run_eval(checkpoint, specs, options, harness_tasks=harness_tasks, layout=Layout(**layout),
                          batch_size=batch_size, tokenizer_model=tokenizer_model, precision=precision,
                          max_length=max_length)
    except (ValueError, OSError, CheckpointError, ImportError, JobEnvError) as e:
        raise click.ClickException(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    if os.environ.get("RANK", "0") != "0":
        return
    lay = report["layout"]
    click.echo(f"mg eval: {checkpoint} at tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} "
               f"({lay['processes']} processes), {report['precision']}, {report['elapsed_s']:.1f} s")
    click.echo(format_table(report["results"]))
    for r in report["results"]:
        for note in r.get("notes", []):
            click.echo(f"note: {r['task']}: {note}", err=True)
    if json_path:
        write_json(json_path, report)
        click.echo(f"wrote {json_path}")
