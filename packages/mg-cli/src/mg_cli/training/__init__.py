"""The training loop of ``mg train`` and the pieces it composes."""

from mg_cli.training.setup import TrainingError


def run_training(*args, **kwargs):  # noqa: ANN002, ANN003
    """See :func:`mg_cli.training.loop.run_training` (imported lazily: it pulls in torch)."""
    from mg_cli.training.loop import run_training as run

    return run(*args, **kwargs)


def preflight_for(config, world_size: int):  # noqa: ANN001, ANN201
    """Run the pre-launch checks as a job of ``world_size`` processes would (see ``loop.preflight``)."""
    from mg_cli.job import Env
    from mg_cli.training.loop import preflight

    return preflight(config, Env(rank=0, world_size=world_size, local_rank=0, local_world_size=world_size))


__all__ = ["TrainingError", "preflight_for", "run_training"]
