"""``mg train``: pretrain a model from a YAML config, on one or many processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click


@click.command("train", context_settings={"show_default": True})
@click.option("--config", "config_path", envvar="MG_TRAIN_CONFIG", type=click.Path(path_type=Path), default=None,
              help="YAML run configuration (sections model, parallel, train, optim, data, eval, checkpoint, log).")
@click.option("--set", "overrides", multiple=True, envvar="MG_TRAIN_SET", metavar="SECTION.KEY=VALUE",
              help="Override one config key (repeatable); the value is parsed as YAML and type-checked.")
@click.option("--resume", is_flag=True, help="Resume from the latest checkpoint under checkpoint.save.")
@click.option("--nproc-per-node", type=int, default=1, help="Processes to start on this node (torch.distributed.run).")
@click.option("--nnodes", type=int, default=1, help="Number of nodes (multi-node: run this command on every node).")
@click.option("--node-rank", type=int, default=0, help="This node's rank among --nnodes.")
@click.option("--master-addr", default=None, help="Address of node 0 for the rendezvous.")
@click.option("--master-port", type=int, default=None, help="Port on node 0 for the rendezvous.")
@click.option("--list-keys", is_flag=True, help="Print every config key with its default and help, then exit.")
@click.option("--print-config", is_flag=True, help="Print the resolved config and exit.")
def train(config_path: Path | None, overrides: tuple[str, ...], resume: bool, nproc_per_node: int, nnodes: int,
          node_rank: int, master_addr: str | None, master_port: int | None, list_keys: bool, print_config: bool) -> None:
    """Pretrain a model described by a YAML config.

    dp is derived from the world size: processes / (tp x pp).

    \b
    Examples:
      mg train --config examples/tiny_gpt.yaml
      mg train --config run.yaml --set parallel.tp=2 --nproc-per-node 2
      mg train --config run.yaml --resume                      # continue from checkpoint.save's latest
      torchrun --nproc-per-node 8 -m mg_cli.main train --config run.yaml
      srun python -m mg_cli.main train --config run.yaml       # MASTER_ADDR/PORT exported
    """
    from mg_cli.config import ConfigError, describe, load_config
    from mg_cli.launch import die_with_parent, launch_id, under_launcher

    stop = None
    if under_launcher():  # a worker takes the signals over before the heavy imports, and dies with its launcher
        from mg_cli.training.signals import SignalFlag

        stop = SignalFlag().install()
    die_with_parent()
    if list_keys:
        click.echo(describe())
        return

    from mg_cli import launch

    def read_config():  # noqa: ANN202 - a RunConfig
        try:
            return load_config(config_path, overrides)
        except ConfigError as e:
            raise click.ClickException(str(e)) from None

    if print_config:
        click.echo(read_config().to_yaml(), nl=False)
        return

    def checked_config():  # noqa: ANN202 - a RunConfig
        config = read_config()
        if os.environ.get("RANK", "0") == "0" and not (under_launcher() and launch_id()):  # once per job
            for note in config.notes:
                click.echo(f"mg train: {note}", err=True)
        if resume and not (config.checkpoint.load or config.checkpoint.save):
            raise click.ClickException("--resume needs checkpoint.save (or checkpoint.load) in the config")
        return config

    if (nproc_per_node > 1 or nnodes > 1) and not launch.under_launcher():
        def preflight() -> None:  # fail once, in one line, before starting any worker
            from mg_cli.job import JobEnvError
            from mg_cli.training import TrainingError, preflight_for

            config = checked_config()
            try:
                preflight_for(config, nproc_per_node * nnodes)
            except (TrainingError, JobEnvError, ConfigError) as e:
                raise click.ClickException(str(e)) from None

        argv = ["train"]
        if config_path is not None:
            argv += ["--config", str(config_path)]
        for o in overrides:
            argv += ["--set", o]
        if resume:
            argv.append("--resume")
        # The launcher starts (and imports torch) while the config is read and checked here.
        code = launch.relaunch(argv, nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
                               master_addr=master_addr, master_port=master_port, preflight=preflight)
        sys.exit(code)
    config = checked_config()
    launch.adopt_slurm_env()

    from mg_cli.job import JobEnvError
    from mg_cli.training import TrainingError, run_training

    if stop is None:
        from mg_cli.training.signals import SignalFlag

        stop = SignalFlag()
        stop.install()
    stop.usr1_continues = config.checkpoint.on_signal == "save_and_continue"
    try:
        summary = run_training(config, resume=resume, stop=stop)
    except (TrainingError, JobEnvError, ConfigError) as e:
        raise click.ClickException(str(e)) from None
    finally:
        stop.restore()
    # Tells the launcher this rank ended cleanly, even if a signal reached the launcher meanwhile.
    launch.report_clean_end(summary["iteration"], summary.get("saved"), summary.get("signal", 0))
