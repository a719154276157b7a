"""A training step that is not logged reads nothing back from the device: no ``.item()``, ``.tolist()``,
``.cpu()``, ``.numpy()`` or Python number/bool conversion of a tensor (each waits for an accelerator's queue). Only
the logged steps (every ``log.interval``) read the loss, its parts and the gradient norm. Counted in-process on
the tiny GPT with gradient clipping and four micro-batches per step."""

from __future__ import annotations

import pytest
import torch

from mg_cli.config import load_config
from tests.e2e.conftest import TINY

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


@pytest.fixture
def reads(monkeypatch):
    """Counts of the host reads of tensors, by method, while ``counting`` is on."""
    counts: dict[str, int] = {}
    state = {"on": False}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            if state["on"]:
                counts[_name] = counts.get(_name, 0) + 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts, state


def test_unlogged_steps_read_nothing_back(corpus, tmp_path, reads):
    from mg_ckpt import CheckpointSaver
    from mg_cli.job import Env
    from mg_cli.training.loop import preflight
    from mg_cli.training.run import build_run
    from mg_cli.training.step import check_loss, train_step

    counts, state = reads
    sets = [*TINY, "train.iters=6", f"data.path={corpus['prefix']}", f"data.tokenizer_model={corpus['tokenizer']}",
            f"log.dir={tmp_path / 'log'}", "log.interval=3"]
    config = load_config(None, sets)
    env = Env(rank=0, world_size=1, local_rank=0, local_world_size=1)
    with CheckpointSaver() as saver:
        run = build_run(config, env, preflight(config, env), None, saver)
        batches = run.data.train_iterator(0)
        logged = train_step(run, 1, batches)  # warm-up and a logged step: it reads its values
        assert logged.logged and logged.loss > 0 and logged.grad_norm > 0
        state["on"] = True
        for iteration in (2, 3):
            result = train_step(run, iteration, batches, log=False)
            assert not result.logged and result.loss is None and result.grad_norm is None
        state["on"] = False
        assert counts == {}, f"unlogged steps read tensors back: {counts}"
        check_loss(run, result)  # reads the loss back, as the loop does before saving
        state["on"] = True
        last = train_step(run, 4, batches)
        state["on"] = False
    assert last.logged and last.loss > 0 and last.grad_norm > 0
    assert counts, "a logged step reads its loss and gradient norm: the counter sees nothing"
    assert last.seconds > 0
