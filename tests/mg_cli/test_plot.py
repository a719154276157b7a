"""`mg plot`: metrics.jsonl to PNG, through the real CLI."""

import json

from click.testing import CliRunner

from mg_cli.main import cli


def test_plot_writes_png_and_tolerates_torn_last_line(tmp_path):
    rows = [{"iteration": i, "loss": 5.0 / i, "tokens_per_s": 1000.0 + i} for i in range(1, 21)]
    rows.append({"iteration": 20, "val_loss": 0.4, "val_ppl": 1.49})
    text = "\n".join(json.dumps(r) for r in rows) + '\n{"iteration": 21, "lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    result = CliRunner().invoke(cli, ["plot", str(tmp_path)])
    assert result.exit_code == 0, result.output
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_missing_logdir_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(cli, ["plot", str(tmp_path / "nope")])
    assert result.exit_code == 1
    assert "metrics.jsonl does not exist" in result.output and "Traceback" not in result.output


def _png_width(path) -> int:
    return int.from_bytes(path.read_bytes()[16:20], "big")  # the IHDR chunk's width


def test_plot_draws_the_moe_load_balance_as_its_own_panel(tmp_path):
    from mg_cli.commands.plot import moe_layers

    dense = [{"iteration": i, "loss": 5.0 / i, "tokens_per_s": 1000.0} for i in range(1, 11)]
    moe = [{**r, **{f"moe_load/{layer}/{end}": 1.0 + (0.5 if end == "max" else -0.5) / r["iteration"]
                    for layer in (1, 3) for end in ("min", "max", "std")}} for r in dense]
    assert moe_layers(moe) == [1, 3] and moe_layers(dense) == []
    widths = []
    for name, rows in (("dense", dense), ("moe", moe)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        result = CliRunner().invoke(cli, ["plot", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        widths.append(_png_width(tmp_path / name / "curves.png"))
    assert widths == [1100, 1650]  # two panels of 5.5 in at 100 dpi; a third for the load balance
