"""How ``load_pretrained`` finds the loaders of other checkpoint formats: entry points of ``mg_models.checkpoint_loaders``,
loaded once on first need, beside loaders registered at run time; a broken entry point is named in one line.

The installed entry points are replaced by fakes here, so this runs with mg-models alone (mg checkpoints and
Hugging Face directories mg-models reads itself: tests/e2e/test_load_pretrained.py).
"""

from __future__ import annotations

import importlib.metadata
from importlib.metadata import EntryPoint

import pytest
import torch

from mg_models import GPTConfig, GPTModel, load_pretrained, pretrained
from mg_models.pretrained import CHECKPOINT_LOADER_GROUP, register_checkpoint_loader

CONFIG = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=50, max_position_embeddings=16)
MARKER = "fake-checkpoint.txt"


def marker_loader(path):
    """A loader for directories holding MARKER: a GPT built with seed 5."""
    if not (path / MARKER).is_file():
        return None
    return CONFIG, GPTModel(CONFIG, seed=5).state_dict()


NOT_A_LOADER = 42


@pytest.fixture
def installed(monkeypatch):
    """Replace the installed entry points with the ones a test sets; counts the scans."""
    found: list[EntryPoint] = []
    scans = []

    def entry_points(*, group):
        scans.append(group)
        return [ep for ep in found if ep.group == group]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(pretrained, "MG_CHECKPOINT_LOADERS", [])
    monkeypatch.setattr(pretrained, "_entry_point_errors", None)
    return found, scans


def _ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=CHECKPOINT_LOADER_GROUP)


def test_entry_point_loader_is_found_once(installed, tmp_path):
    found, scans = installed
    found.append(_ep("fake", f"{__name__}:marker_loader"))
    (tmp_path / MARKER).write_text("")
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(0))
    ref = GPTModel(CONFIG, seed=5).eval()
    with torch.no_grad():
        for _ in range(2):
            model = load_pretrained(tmp_path)
            assert torch.equal(model(ids), ref(ids, gather_logits=True))
    assert scans == [CHECKPOINT_LOADER_GROUP]  # discovered on the first call only
    assert pretrained.MG_CHECKPOINT_LOADERS == [marker_loader]


def test_registered_loaders_come_first_and_are_kept(installed, tmp_path):
    found, _ = installed
    found.append(_ep("fake", f"{__name__}:marker_loader"))
    calls = []

    def explicit(path):
        calls.append(path)
        return None

    register_checkpoint_loader(explicit)
    register_checkpoint_loader(explicit)  # once only
    (tmp_path / MARKER).write_text("")
    assert isinstance(load_pretrained(tmp_path), GPTModel)
    assert calls == [tmp_path] and pretrained.MG_CHECKPOINT_LOADERS == [explicit, marker_loader]


def test_broken_entry_points_are_named_in_one_line(installed, tmp_path):
    found, _ = installed
    found += [_ep("broken", "mg_no_such_module:load"), _ep("number", f"{__name__}:NOT_A_LOADER")]
    with pytest.raises(ValueError) as info:
        load_pretrained(tmp_path)
    message = str(info.value)
    assert "\n" not in message and info.value.__cause__ is None and info.value.__context__ is None
    assert (f"entry point 'broken' = 'mg_no_such_module:load' (group '{CHECKPOINT_LOADER_GROUP}') failed to load: "
            f"ModuleNotFoundError: No module named 'mg_no_such_module'; reinstall the package that declares it"
            ) in message
    assert (f"entry point 'number' = '{__name__}:NOT_A_LOADER' (group '{CHECKPOINT_LOADER_GROUP}') is not callable "
            f"(a int object)") in message
    # A broken plugin does not stop what other loaders (here the Hugging Face reader) can open.
    from mg_models.hf import write_hf_directory

    write_hf_directory(tmp_path / "hf", GPTModel(CONFIG, seed=5).state_dict(), CONFIG, "gpt2")
    assert isinstance(load_pretrained(tmp_path / "hf"), GPTModel)


def test_without_loaders_the_error_says_what_the_directory_is_not(installed, tmp_path):
    with pytest.raises(ValueError, match=r"neither a Hugging Face directory \(no config.json\) nor an mg checkpoint "
                                         r"\(an iter_\* directory with metadata.json, or a save directory with latest\)$"):
        load_pretrained(tmp_path)
