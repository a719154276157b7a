"""The build-once index cache: stale locks, waiting for another builder, content-addressed keys."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from mg_data.index_cache import cached_arrays, fingerprint


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    key = fingerprint("k")
    (tmp_path / f"x-{key}.lock").write_text(f"{socket.gethostname()} {dead_pid()} 0")
    out, built = cached_arrays(tmp_path, "x", key, ["a"], lambda: {"a": np.arange(3)}, wait_timeout_s=30)
    assert built and out["a"].tolist() == [0, 1, 2]
    assert not (tmp_path / f"x-{key}.lock").exists()


def test_waits_for_a_live_builder_then_loads(tmp_path):
    key = fingerprint("w")
    lock = tmp_path / f"w-{key}.lock"
    lock.write_text(f"{socket.gethostname()} {os.getpid()} 0")  # held by a live process (us)

    def finish_later():
        time.sleep(0.5)
        cached_arrays(tmp_path, "w", key, ["a"], lambda: {"a": np.arange(4)}, wait_timeout_s=0)
        lock.unlink()

    t = threading.Thread(target=finish_later)
    t.start()
    out, built = cached_arrays(tmp_path, "w", key, ["a"], lambda: pytest.fail("must not build"), wait_timeout_s=30)
    t.join()
    assert not built and out["a"].tolist() == [0, 1, 2, 3]


def test_fingerprint_depends_on_every_part():
    a = np.arange(5, dtype=np.int32)
    base = fingerprint(a, 1, "x")
    assert base == fingerprint(a.copy(), 1, "x")
    assert base != fingerprint(a.astype(np.int64), 1, "x")
    assert base != fingerprint(a[::-1].copy(), 1, "x")
    assert base != fingerprint(a, 2, "x")
    assert base != fingerprint(a, 1, "y")
