"""mg-ckpt benchmark: save/load throughput vs raw file I/O, reshard-on-load cost, async-save stall.

Run from the repo root:  .venv/bin/python benchmarks/bench_ckpt.py [--gib 1.0] [--dir /tmp]

All figures are ratios against references measured in the same run on the same bytes; each
measured run is interleaved with its reference and the best of N of each is kept (the machine
is shared, so a single run says little):

* checksum cost: CPU seconds per GB (thread CPU time, so insensitive to load) of CRC-32 (new
  files) and SHA-256 (format version 1) on one core;
* save: ``save_checkpoint`` (write + checksum + fsync + commit) vs writing the same bytes to one
  file with ``write`` + ``fsync``; with ``--sha256`` also saves with SHA-256 checksums (format v1);
* load: ``load_checkpoint`` (with and without checksum verification) vs ``readinto`` of that raw
  file into preallocated memory. The page cache cannot be dropped here, so both reads are mostly
  served from memory (the files were just written): this compares software overhead, not disks;
* reshard: for three 4-rank layouts (tp=4 row shards, tp=4 column shards, dp=4 flat ranges of
  a distributed optimizer), loading the tp=1 checkpoint into that layout vs loading a checkpoint
  saved *in that layout* (written by 4 real ranks) into it: the issue's "load-with-reshard time
  vs same-layout load". The 4 ranks' loads run one after another in this process. The ratio to
  loading the whole state from the tp=1 checkpoint is printed too;
* async stall: a training-like loop (matmuls, ~``--step`` seconds, then an in-place update of the
  whole state as an optimizer step would) triggers an async save; the triggering step's time vs
  the median of 4 normal steps measured around it (2 before, 2 after the save). Default mode (the call returns after the
  copy) and ``background_snapshot=True`` (the copy overlaps the matmuls; the loop calls
  ``wait_for_snapshot()`` right before its in-place update).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
import zlib

import torch

import mg_ckpt.save as save_mod
from mg_ckpt import ShardedTensor, finalize, load_checkpoint, save_checkpoint
from mg_ckpt.save import wait_for_snapshot

KINDS = ("rows", "cols", "flat")
WORLD = 4


def make_state(total_bytes: int, n: int = 16) -> dict[str, torch.Tensor]:
    cols = 4096  # 16 KiB rows: a tp=4 column shard reads 4 KiB runs
    rows = total_bytes // (4 * n * cols)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(rows, cols, generator=g) for i in range(n)}


def layout_template(kind: str, shapes: dict[str, tuple[int, int]], r: int) -> dict[str, ShardedTensor]:
    """Rank ``r``'s zero-filled (touched, as a model's parameters are) pieces of the 4-rank layout ``kind``."""
    out = {}
    for k, (rows, cols) in shapes.items():
        if kind == "flat":
            n = rows * cols // WORLD
            out[k] = ShardedTensor(torch.zeros(n), (rows, cols), (0, 0), (rows, cols), (r * n, (r + 1) * n))
        else:
            dim = 0 if kind == "rows" else 1
            local = [rows, cols]
            local[dim] //= WORLD
            out[k] = ShardedTensor.from_split(torch.zeros(local), dim, r, WORLD)
    return out


def save_layouts(src: str, root: str, shapes: dict[str, tuple[int, int]]) -> None:
    """On each of 4 ranks: read this rank's pieces of every layout from ``src``, save them as ``root/<kind>``."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for kind in KINDS:
        state = layout_template(kind, shapes, rank)
        load_checkpoint(src, state, verify=False)
        save_checkpoint(os.path.join(root, kind), 1, state, layout={"kind": kind, "world": WORLD})


def raw_write(path: str, state: dict[str, torch.Tensor]) -> float:
    t = time.perf_counter()
    with open(path, "wb") as f:
        for v in state.values():
            f.write(memoryview(v.reshape(-1).numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t


def raw_read(path: str, nbytes: int) -> float:
    buf = torch.zeros(nbytes, dtype=torch.uint8)  # touched first, like the load's template
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buf.numpy())
        got = 0
        while got < nbytes:
            got += f.readinto(view[got:])
    return time.perf_counter() - t


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def interleaved(fns: dict[str, object], rounds: int, setup=None) -> dict[str, list[float]]:
    """Times of each function in each of ``rounds`` rounds, the functions alternating within a round.

    A function returning a float reports its own time (e.g. leaving out a buffer allocation);
    ``setup`` runs, untimed, before each call.
    """
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            if setup is not None:
                setup()
            t = time.perf_counter()
            own = fn()
            out[k].append(own if isinstance(own, float) else time.perf_counter() - t)
    return out


def ratios(times: dict[str, list[float]], ref: str, key: str) -> tuple[float, float]:
    """(ratio of the best times, median of the per-round ratios) of ``times[ref] / times[key]``."""
    per_round = [a / b for a, b in zip(times[ref], times[key])]
    return min(times[ref]) / min(times[key]), statistics.median(per_round)


def cpu_seconds_per_gb(fn, data: memoryview) -> float:
    t = time.thread_time()
    fn(data)
    return (time.thread_time() - t) / (len(data) / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    ap.add_argument("--dir", default=None, help="scratch directory (default: system temp)")
    ap.add_argument("--step", type=float, default=2.0, help="target seconds per training-like step")
    ap.add_argument("--sha256", action="store_true", help="also time saves with SHA-256 checksums (format v1's)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="mg-bench-ckpt-", dir=args.dir)
    t_start = time.perf_counter()
    try:
        state = make_state(int(args.gib * 2**30))
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        nbytes = sum(v.numel() * 4 for v in state.values())
        gb = nbytes / 1e9
        print(f"state: {len(state)} tensors, {gb:.2f} GB fp32; scratch dir {root}; torch threads {torch.get_num_threads()}; "
              f"load average {os.getloadavg()[0]:.1f}")

        sample = memoryview(next(iter(state.values())).reshape(-1).numpy()).cast("B")
        crc = min(cpu_seconds_per_gb(zlib.crc32, sample) for _ in range(3))
        sha = min(cpu_seconds_per_gb(lambda b: hashlib.sha256(b).digest(), sample) for _ in range(3))
        print(f"checksum CPU cost (one core): crc32 {crc:.2f} s/GB, sha256 {sha:.2f} s/GB")

        raw = os.path.join(root, "raw.bin")
        save_dir = os.path.join(root, "ckpt")
        it = iter(range(1, 1000))

        def save_with(algorithm: str) -> None:
            save_mod.CHECKSUM = algorithm
            try:
                save_checkpoint(save_dir, next(it), state)
            finally:
                save_mod.CHECKSUM = "crc32"

        def clean() -> None:
            # Every write starts on an empty directory with deletions flushed (ext4 with discard
            # here: deleting 1 GB costs I/O that would otherwise land in the next measurement).
            shutil.rmtree(save_dir, ignore_errors=True)
            if os.path.exists(raw):
                os.remove(raw)
            os.sync()

        writes = {"raw": lambda: raw_write(raw, state), "crc32": lambda: save_with("crc32")}
        if args.sha256:
            writes["sha256"] = lambda: save_with("sha256")
        w = interleaved(writes, 3, setup=clean)
        clean()
        raw_write(raw, state)
        save_with("crc32")  # the checkpoint the loads read
        template = {k: torch.zeros_like(v) for k, v in state.items()}
        r = interleaved({"raw": lambda: raw_read(raw, nbytes), "load": lambda: load_checkpoint(save_dir, template, verify=False),
                         "verify": lambda: load_checkpoint(save_dir, template, verify=True)}, 3)
        assert all(torch.equal(template[k], state[k]) for k in state)
        os.remove(raw)
        template.clear()
        print("best of 3 interleaved rounds; ratios: of the best times, then the median of the 3 per-round ratios")
        print(f"raw write+fsync          {gb / min(w['raw']):6.2f} GB/s")
        for key, what in (("crc32", "save_checkpoint (crc32) "), ("sha256", "save, sha256 (format v1)")):
            if key not in w:
                continue
            best, med = ratios(w, "raw", key)
            print(f"{what} {gb / min(w[key]):6.2f} GB/s   ratio to raw write {best:.2f}, {med:.2f}"
                  + ("  (target >= 0.7)" if key == "crc32" else ""))
        print(f"raw read (page cache)    {gb / min(r['raw']):6.2f} GB/s")
        for key, what in (("load", "load, verify=False      "), ("verify", "load, verify=True       ")):
            best, med = ratios(r, "raw", key)
            print(f"{what} {gb / min(r[key]):6.2f} GB/s   ratio to raw read  {best:.2f}, {med:.2f}"
                  + ("  (target >= 0.7)" if key == "load" else "  (crc32 of every byte)"))
        t_load = min(r["load"])

        # Checkpoints saved in each 4-rank layout, by 4 ranks, for the same-layout references.
        from mg_parallel.testing import run_distributed, shutdown_pools

        layouts = os.path.join(root, "layouts")
        t = time.perf_counter()
        run_distributed(save_layouts, WORLD, save_dir, layouts, shapes, timeout=600)
        shutdown_pools()
        print(f"(4 ranks resharded tp1 -> each layout and saved it in {time.perf_counter() - t:.0f} s)")
        for kind in KINDS:
            templates = [layout_template(kind, shapes, rank) for rank in range(WORLD)]
            same = os.path.join(layouts, kind, "iter_0000001")

            def load_all(path: str, templates=templates) -> None:
                for tmpl in templates:
                    load_checkpoint(path, tmpl, verify=False)

            t = interleaved({"same": lambda same=same: load_all(same), "reshard": lambda: load_all(save_dir)}, 3)
            best, med = ratios(t, "reshard", "same")
            print(f"reshard tp1 -> 4 x {kind:4s}  {best:5.2f}, {med:.2f} x same-layout load ({min(t['same']):.2f} s) "
                  f"(target <= 1.5); {min(t['reshard']) / t_load:5.2f} x the tp1 whole-state load")
            del templates
        shutil.rmtree(layouts, ignore_errors=True)

        # Async stall on a training-like loop.
        n = 1536
        a, b = torch.randn(n, n), torch.randn(n, n)
        reps = 1

        def matmuls(k: int) -> float:
            return timed(lambda: [a @ b for _ in range(k)])

        while matmuls(reps) < args.step / 2:
            reps *= 2
        reps = max(1, int(reps * args.step / matmuls(reps)))

        def train_step() -> None:
            for _ in range(reps):  # forward + backward: they only read the state
                torch.matmul(a, b)
            t = time.perf_counter()
            wait_for_snapshot()  # returns at once unless a background snapshot is pending
            waits.append(time.perf_counter() - t)
            for v in state.values():  # the optimizer updates the state in place
                v.mul_(1.0)

        waits: list[float] = []

        def trigger(iteration: int, background: bool) -> tuple[float, float, float, float, list[float]]:
            clean()  # no deletion of an older checkpoint overlaps the steps measured
            normal = [timed(train_step) for _ in range(2)]
            t = time.perf_counter()
            handle = save_checkpoint(save_dir, iteration, state, async_save=True, background_snapshot=background)
            t_call = time.perf_counter() - t
            train_step()
            t_step = time.perf_counter() - t
            t_wait = waits[-1]
            during = []
            while not handle.done() and len(during) < 1:  # bounded: the writer may be starved of CPU
                during.append(timed(train_step))
            handle.wait()
            normal += [timed(train_step) for _ in range(2)]  # the load drifts: normal steps on both sides
            base = statistics.median(normal)
            return base, t_call, t_wait, t_step, [d / base for d in during]

        # The first asynchronous save allocates and first-touches the staging buffers (kept for the
        # next saves, whichever mode): a one-off cost, timed here and left out of the steady state.
        clean()
        t_first = timed(lambda: save_checkpoint(save_dir, 9, state, async_save=True))
        finalize()
        runs = []
        for i in range(3):  # the modes alternate
            for background in (False, True):
                runs.append((background, i) + trigger(10 + 2 * i + background, background))
        finalize()
        print(f"async save ({gb:.2f} GB snapshot), training-like step ~{args.step:.0f} s; each triggering step vs the "
              f"median of 4 normal steps, 2 before it and 2 after the save completed (first save's call, allocating buffers: {t_first:.2f} s):")
        for background, i, base, t_call, t_wait, t_step, during in runs:
            mode = "background_snapshot" if background else "default            "
            later = f"{statistics.mean(during):.2f} x" if during else "-"
            print(f"  {mode} save {i + 1}: triggering step {t_step / base:.2f} x normal ({base:.2f} s; target < 1.10); "
                  f"call returned after {t_call:.2f} s, wait_for_snapshot {t_wait:.2f} s; next {len(during)} steps {later}")
        for background in (False, True):
            steady = [t_step / base for bg, i, base, _, _, t_step, _ in runs if bg == background]
            print(f"  median triggering step, {'background_snapshot' if background else 'default'}: "
                  f"{statistics.median(steady):.2f} x normal")
        print(f"total {time.perf_counter() - t_start:.0f} s, load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
