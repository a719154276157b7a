"""mg-ckpt benchmark: save/load throughput vs raw file I/O, async-save stall, reshard-on-load cost.

Run from the repo root:  .venv/bin/python benchmarks/bench_ckpt.py [--gib 1.0] [--dir /tmp]

All figures are ratios against references measured in the same run on the same bytes:

* save: ``save_checkpoint`` (write + SHA-256 + fsync + commit) vs writing the same bytes to one file
  with ``write`` + ``fsync``;
* load: ``load_checkpoint`` (with and without checksum verification) vs ``readinto`` of that raw
  file into preallocated memory. The page cache cannot be dropped here, so both reads are mostly
  served from memory (the files were just written): this compares software overhead, not disks;
* reshard: loading the tp=1 checkpoint as 4 tensor-parallel row shards, 4 column shards, or 4 flat
  data-parallel ranges (the four "ranks" run one after another in this process) vs the
  same-layout load;
* async stall: a training-like loop (matmuls, ~``--step`` seconds per step) triggers an async save
  of the state; the triggering step's time (snapshot copy included) vs the mean normal step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from mg_ckpt import ShardedTensor, finalize, load_checkpoint, save_checkpoint


def make_state(total_bytes: int, n: int = 16) -> dict[str, torch.Tensor]:
    cols = 4096  # 16 KiB rows: a tp=4 column shard reads 4 KiB runs
    rows = total_bytes // (4 * n * cols)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(rows, cols, generator=g) for i in range(n)}


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


def best(fn, repeat: int) -> float:
    return min(timed(fn) for _ in range(repeat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    ap.add_argument("--dir", default=None, help="scratch directory (default: system temp)")
    ap.add_argument("--step", type=float, default=2.0, help="target seconds per training-like step")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="mg-bench-ckpt-", dir=args.dir)
    try:
        state = make_state(int(args.gib * 2**30))
        nbytes = sum(v.numel() * 4 for v in state.values())
        gb = nbytes / 1e9
        print(f"state: {len(state)} tensors, {gb:.2f} GB fp32; scratch dir {root}; torch threads {torch.get_num_threads()}")

        raw = os.path.join(root, "raw.bin")
        t_raw_w = min(raw_write(raw, state), raw_write(raw, state))
        save_dir = os.path.join(root, "ckpt")
        t_save = min(timed(lambda it=it: save_checkpoint(save_dir, it, state, keep_last=1)) for it in (1, 2))
        t_raw_r = min(raw_read(raw, nbytes) for _ in range(3))
        os.remove(raw)

        template = {k: torch.empty_like(v) for k, v in state.items()}
        t_load = best(lambda: load_checkpoint(save_dir, template, verify=False), 3)
        assert all(torch.equal(template[k], state[k]) for k in state)
        t_load_v = best(lambda: load_checkpoint(save_dir, template, verify=True), 2)

        # Templates are allocated and touched beforehand, as a model's parameters are when it loads.
        def split_templates(dim: int) -> list[dict[str, ShardedTensor]]:
            out = []
            for r in range(4):
                out.append({})
                for k, v in state.items():
                    shape = list(v.shape)
                    shape[dim] //= 4
                    out[-1][k] = ShardedTensor.from_split(torch.zeros(shape), dim, r, 4)
            return out

        def flat_templates() -> list[dict[str, ShardedTensor]]:
            out = []
            for r in range(4):
                out.append({})
                for k, v in state.items():
                    n = v.numel() // 4
                    out[-1][k] = ShardedTensor(torch.zeros(n), v.shape, (0, 0), v.shape, (r * n, (r + 1) * n))
            return out

        def load_all(templates: list[dict[str, ShardedTensor]]) -> None:
            for tmpl in templates:
                load_checkpoint(save_dir, tmpl, verify=False)

        template.clear()

        def reshard_time(make) -> float:
            templates = make()
            return best(lambda: load_all(templates), 2)

        t_tp4 = reshard_time(lambda: split_templates(1))
        t_tp4r = reshard_time(lambda: split_templates(0))
        t_dp4 = reshard_time(flat_templates)

        print(f"raw write+fsync        {gb / t_raw_w:6.2f} GB/s")
        print(f"save_checkpoint        {gb / t_save:6.2f} GB/s   ratio to raw write {t_raw_w / t_save:.2f}  (target >= 0.7)")
        print(f"raw read (page cache)  {gb / t_raw_r:6.2f} GB/s")
        print(f"load, verify=False     {gb / t_load:6.2f} GB/s   ratio to raw read  {t_raw_r / t_load:.2f}  (target >= 0.7)")
        print(f"load, verify=True      {gb / t_load_v:6.2f} GB/s   ratio to raw read  {t_raw_r / t_load_v:.2f}  (SHA-256 of every byte)")
        print(f"reshard tp1->tp4 rows  {t_tp4r / t_load:6.2f} x same-layout load time (target <= 1.5)")
        print(f"reshard tp1->tp4 cols  {t_tp4 / t_load:6.2f} x same-layout load time (target <= 1.5; 4 KiB runs per row)")
        print(f"reshard tp1->dp4 flat  {t_dp4 / t_load:6.2f} x same-layout load time (target <= 1.5)")

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
            for _ in range(reps):
                torch.matmul(a, b)
            for v in state.values():  # the optimizer updates the state in place
                v.mul_(1.0)

        def trigger(iteration: int) -> tuple[float, float, list[float]]:
            t = time.perf_counter()
            handle = save_checkpoint(save_dir, iteration, state, async_save=True, keep_last=1)
            t_call = time.perf_counter() - t
            train_step()
            t_step = time.perf_counter() - t
            during = []
            while not handle.done() and len(during) < 4:  # bounded: the writer may be starved of CPU
                during.append(timed(train_step))
            handle.wait()
            return t_call, t_step, during

        normal = [timed(train_step) for _ in range(3)]
        first = trigger(3)
        normal += [timed(train_step) for _ in range(2)]
        second = trigger(4)
        finalize()
        base = statistics.median(normal)
        print(f"async save: normal step {base:.2f} s (median of {len(normal)})")
        for what, (t_call, t_step, during) in (("first", first), ("next ", second)):
            mean = statistics.mean(during) if during else float("nan")
            print(
                f"  {what} save: triggering step {t_step:.2f} s = {t_step / base:.2f} x normal (target < 1.10); "
                f"the call returned after {t_call:.2f} s (snapshot of {gb:.2f} GB); "
                f"the next {len(during)} steps (overlapping the background write) took {mean / base:.2f} x"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
