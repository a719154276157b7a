"""The installed distribution: version and declared dependencies."""

import importlib.metadata as md

import mg_cli


def test_version_matches_metadata():
    assert mg_cli.__version__ == md.version("mg-cli")


def test_siblings_are_minimum_versions_not_pins():
    for req in md.requires("mg-cli") or []:
        if req.startswith("mg-"):
            spec = req.split(";")[0]
            assert ">=" in spec and "==" not in spec, req


def test_help_is_instant_and_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys; from mg_cli.main import cli; cli(['--help'], prog_name='mg', standalone_mode=False); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "Usage: mg" in out
    assert out.strip().endswith("False"), "mg --help imported torch"


def test_help_lists_every_command():
    from click.testing import CliRunner

    from mg_cli.main import cli

    out = CliRunner().invoke(cli, ["--help"]).output
    for name in ("train", "preprocess", "tokenizer", "convert", "generate", "inspect", "plot"):
        assert f"  {name} " in out, out
    for name in ("train", "preprocess", "tokenizer", "convert", "generate", "inspect", "plot"):
        sub = CliRunner().invoke(cli, [name, "--help"])
        assert sub.exit_code == 0 and "Usage:" in sub.output, (name, sub.output)


def test_options_come_from_mg_environment_variables():
    from click.testing import CliRunner

    from mg_cli.main import cli

    out = CliRunner().invoke(cli, ["train", "--print-config"], env={"MG_TRAIN_SET": "train.iters=77"}).output
    assert "iters: 77" in out, out
