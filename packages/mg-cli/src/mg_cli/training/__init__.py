"""The training loop of ``mg train`` and the pieces it composes."""

from mg_cli.training.setup import TrainingError


def run_training(*args, **kwargs):  # noqa: ANN002, ANN003
    """See :func:`mg_cli.training.loop.run_training` (imported lazily: it pulls in torch)."""
    from mg_cli.training.loop import run_training as run

    return run(*args, **kwargs)


__all__ = ["TrainingError", "run_training"]
