"""Build-once caches of index arrays, safe when many ranks or nodes start at the same time.

Arrays are stored as ``.npy`` files named by a hash of everything that determines them, and
each file is written under a temporary name then renamed. A ``-meta.json`` written last marks the
set complete. Processes that share a filesystem elect one builder with an exclusive lock file; the
others wait for the marker (or build themselves if the holder died or the wait times out). Nodes
without a shared filesystem each build their own copy; the builds are deterministic, so every
copy is identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


def fingerprint(*parts: Any) -> str:
    """Hex digest of ``parts``: numpy arrays hash by dtype, shape and bytes; the rest via JSON."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        if isinstance(p, np.ndarray):
            a = np.ascontiguousarray(p)
            h.update(f"ndarray:{a.dtype.str}:{a.shape}".encode())
            h.update(memoryview(a).cast("B"))
        else:
            h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\x00")
    return h.hexdigest()


def _atomic_save(path: str, arr: np.ndarray) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)


def _lock_is_stale(lock: str) -> bool:
    try:
        with open(lock) as f:
            host, pid = f.read().split()[:2]
    except (OSError, ValueError):
        return False  # being written right now, or gone
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    return False


def cached_arrays(cache_dir: str | os.PathLike[str] | None, name: str, key: str, array_names: Sequence[str],
                  build: Callable[[], Mapping[str, np.ndarray]], description: Mapping[str, Any] | None = None,
                  *, wait_timeout_s: float = 900.0, poll_s: float = 0.05) -> tuple[dict[str, np.ndarray], bool]:
    """Load arrays ``array_names`` cached under ``cache_dir/{name}-{key}-*``, building them if absent.

    Args:
        cache_dir: directory of the cache; None builds in memory without caching.
        name: readable file-name stem; key: hash of every input of ``build``.
        build: returns a mapping with every name of ``array_names``.
        description: saved in the ``-meta.json`` marker for humans.
        wait_timeout_s: how long to wait for another process's build before building here too.

    Returns:
        (arrays, whether this process built them). Loaded arrays are read-only memory maps.
    """
    if cache_dir is None:
        return dict(build()), True
    cache_dir = os.fspath(cache_dir)
    base = os.path.join(cache_dir, f"{name}-{key}")
    meta, lock = f"{base}-meta.json", f"{base}.lock"
    if not os.path.exists(meta):
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{cache_dir}: cannot create the index cache ({e.strerror}); "
                             "set cache_dir to a writable directory") from None

    def load() -> dict[str, np.ndarray]:
        return {n: np.load(f"{base}-{n}.npy", mmap_mode="r") for n in array_names}

    def build_and_save() -> dict[str, np.ndarray]:
        arrays = dict(build())
        for n in array_names:
            _atomic_save(f"{base}-{n}.npy", np.asarray(arrays[n]))
        tmp = f"{meta}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "w") as f:
            json.dump({"key": key, "arrays": list(array_names), **(description or {})}, f, default=str)
        os.replace(tmp, meta)
        return arrays

    deadline = time.monotonic() + wait_timeout_s
    while True:
        if os.path.exists(meta):
            return load(), False
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except PermissionError:
            raise ValueError(f"{cache_dir}: index cache is not writable and lacks {os.path.basename(meta)}; "
                             "set cache_dir to a writable directory") from None
        except FileExistsError:
            if _lock_is_stale(lock):
                try:
                    os.remove(lock)
                except FileNotFoundError:
                    pass
                continue
            if time.monotonic() > deadline:
                return build_and_save(), True  # the holder is stuck; our result is identical anyway
            time.sleep(poll_s)
            continue
        try:
            os.write(fd, f"{socket.gethostname()} {os.getpid()} {time.time():.0f}".encode())
            os.close(fd)
            if os.path.exists(meta):  # finished between our check and our lock
                return load(), False
            return build_and_save(), True
        finally:
            try:
                os.remove(lock)
            except FileNotFoundError:
                pass
