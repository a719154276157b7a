"""Every ``mg train --config FILE`` in the repository README and the packages' READMEs names a config that exists
and loads with the command's ``--set`` values, and a ``--nproc-per-node N`` command's layout fits N processes
(tp x pp x cp divides N, the global batch splits into micro-batches over dp). Every ``python examples/...``
script they run exists. Nothing is trained: tests/e2e/test_readme.py runs the quick path, the templates need
GPUs or files a reader brings."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from mg_cli.config import load_config
from tests.mg_cli.readme_blocks import shell_lines

REPO = Path(__file__).resolve().parents[2]
READMES = [REPO / "README.md", *sorted((REPO / "packages").glob("*/README.md"))]


def _commands(readme: Path) -> list[list[str]]:
    """Every ``mg`` or ``python`` command of the README's code blocks, split as the shell does."""
    return [shlex.split(line, comments=True) for line in shell_lines(readme) if line.startswith(("mg ", "python "))]


def _train_commands() -> list[tuple[str, list[str]]]:
    out = []
    for readme in READMES:
        for argv in _commands(readme):
            synopsis = any(a.startswith("[") for a in argv)  # mg train --config FILE.yaml [--set ...]
            if argv[:2] == ["mg", "train"] and "--config" in argv and not synopsis:
                out.append((f"{readme.relative_to(REPO)}: {shlex.join(argv)}", argv))
    return out


TRAIN = _train_commands()


def test_the_readmes_train_from_config_files():
    assert any("examples/tiny_gpt.yaml" in argv for _, argv in TRAIN)


@pytest.mark.parametrize("argv", [argv for _, argv in TRAIN], ids=[name for name, _ in TRAIN])
def test_train_command_config_exists_and_loads(argv):
    config = REPO / argv[argv.index("--config") + 1]
    assert config.is_file(), f"{config.relative_to(REPO)} does not exist"
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    cfg = load_config(config, sets)
    if "--nproc-per-node" in argv:
        nproc = int(argv[argv.index("--nproc-per-node") + 1])
        p, t = cfg.parallel, cfg.train
        model_parallel = p.tp * p.pp * p.cp
        assert nproc % model_parallel == 0, f"{nproc} processes do not split into tp x pp x cp = {model_parallel}"
        dp = nproc // model_parallel
        assert t.global_batch_size % (t.micro_batch_size * dp) == 0, \
            f"global batch {t.global_batch_size} is not a multiple of micro-batch {t.micro_batch_size} x dp {dp}"


def test_example_scripts_the_readmes_run_exist():
    scripts = [argv[1] for readme in READMES for argv in _commands(readme)
               if argv[0] == "python" and len(argv) > 1 and argv[1].startswith("examples/")]
    assert scripts, "no README runs an example script"
    for script in scripts:
        assert (REPO / script).is_file(), script
