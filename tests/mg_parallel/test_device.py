"""Device selection: one GPU per local rank, never two ranks on one GPU; the CPU without CUDA."""

import pytest
import torch

from mg_parallel import device


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("MG_FORCE_CPU", raising=False)
    monkeypatch.delenv("SLURM_LOCALID", raising=False)


def test_local_rank_picks_its_own_gpu(two_gpus, monkeypatch):
    for rank in (0, 1):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert device.local_device() == torch.device("cuda", rank)


def test_local_rank_beyond_the_gpus_is_an_error(two_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")  # would have shared cuda:0 with LOCAL_RANK=0
    with pytest.raises(ValueError, match=r"^LOCAL_RANK=2 but this node has 2 visible GPU\(s\), so two ranks would "
                                         r"share one; start at most 2 processes per node") as err:
        device.local_device()
    assert "\n" not in str(err.value)


def test_cpu_when_cuda_is_forced_off(two_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("MG_FORCE_CPU", "1")
    assert device.local_device() == torch.device("cpu")
    assert device.default_backend() == "gloo"
