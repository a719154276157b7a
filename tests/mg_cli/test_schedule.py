"""Learning-rate schedules against their closed forms."""

import math

import pytest

from mg_cli.training.schedule import LRSchedule


def test_warmup_then_cosine():
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110, style="cosine")
    assert s(5) == pytest.approx(0.5)
    assert s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)


def test_linear_constant_wsd():
    lin = LRSchedule(lr=2.0, min_lr=0.0, warmup_iters=0, decay_iters=100, style="linear")
    assert lin(25) == pytest.approx(1.5)
    const = LRSchedule(lr=2.0, min_lr=0.0, warmup_iters=4, decay_iters=100, style="constant")
    assert const(2) == pytest.approx(1.0) and const(1000) == pytest.approx(2.0)
    wsd = LRSchedule(lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=100, style="wsd", wsd_decay_fraction=0.2)
    assert wsd(80) == pytest.approx(1.0) and wsd(90) == pytest.approx(0.5) and wsd(100) == pytest.approx(0.0)


def test_bad_schedule():
    with pytest.raises(ValueError, match="decay_style"):
        LRSchedule(lr=1, min_lr=0, warmup_iters=0, decay_iters=1, style="exp")
    with pytest.raises(ValueError, match="decay_iters=5 is smaller than optim.warmup_iters=10"):
        LRSchedule(lr=1, min_lr=0, warmup_iters=10, decay_iters=5, style="linear")
