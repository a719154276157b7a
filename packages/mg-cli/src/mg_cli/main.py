"""The ``mg`` command.

Sub-commands are registered by name in ``COMMANDS`` and imported only when invoked, so
``mg --help`` answers without importing torch.
"""

from __future__ import annotations

import importlib

import click

from mg_cli import __version__

# name -> ("module:attribute", one-line help shown by `mg --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("mg_cli.commands.train:train", "Pretrain a model from a YAML config, on one or many processes."),
    "preprocess": ("mg_cli.commands.preprocess:preprocess", "Tokenize JSONL text into .bin/.idx datasets."),
    "tokenizer": ("mg_cli.commands.tokenizer:tokenizer", "Train a SentencePiece tokenizer or encode text."),
    "convert": ("mg_cli.commands.convert:convert", "Convert Hugging Face models to mg checkpoints and back."),
    "generate": ("mg_cli.commands.generate:generate", "Continue prompts with a trained checkpoint (KV cache)."),
    "inspect": ("mg_cli.commands.inspect:inspect", "Describe and verify a dataset prefix or a checkpoint."),
    "plot": ("mg_cli.commands.plot:plot", "Render a run's loss and throughput curves to a PNG."),
    "eval": ("mg_cli.commands.eval:eval_command", "Evaluate a checkpoint: perplexity, zero-shot, task metrics, pass@k."),
}


class LazyGroup(click.Group):
    """A Click group whose sub-commands live in modules imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMANDS))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in COMMANDS:
            target, _ = COMMANDS[name]
            module, attr = target.split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in sorted(COMMANDS)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "MG"})
@click.version_option(__version__, prog_name="mg")
def cli() -> None:
    """mg: pretrain transformer language models with data, tensor, sequence and pipeline parallelism."""


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
