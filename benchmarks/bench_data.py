"""mg-data benchmarks: preprocessing throughput, sample access, sample-index build.

Run from the repository root:

    .venv/bin/python benchmarks/bench_data.py [preprocess|access|index|all]

Every figure is printed next to a reference measured in the same run (shared machines are noisy):

* preprocess: ``run_preprocess`` end to end (JSONL file -> merged .bin/.idx, worker start-up
  included) against raw ``SentencePieceProcessor.encode(list_of_texts, num_threads=N)`` on the same
  texts already in memory, at the same N (N worker processes vs N SentencePiece threads). Best of
  several interleaved repeats of each; the input is cut into 8 partitions (the default partition
  size, 64 MiB, would give a single one on this corpus).
* access: random ``GPTDataset.__getitem__`` (seq 2048) against a bare memmap copy of 2049 tokens at
  random offsets of the same >= 1 GB file.
* index: building the three GPT indices for 10 B tokens (10 M documents of ~1000 tokens).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import sentencepiece as spm

from mg_data.gpt_dataset import GPTDataset, GPTDatasetConfig
from mg_data.gpt_indices import build_gpt_indices
from mg_data.indexed import IndexedDataset, IndexedDatasetBuilder
from mg_data.preprocess import PreprocessConfig, run_preprocess
from mg_data.tokenizers import train_sentencepiece


def stdlib_corpus(path: Path, max_bytes: int) -> list[str]:
    """Python standard-library sources as JSONL documents of 100 lines; returns the texts."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    with open(path, "w", encoding="utf-8") as f:
        for p in files:
            lines = p.read_text(encoding="utf-8", errors="replace").split("\n")
            for i in range(0, len(lines), 100):
                text = "\n".join(lines[i:i + 100])
                if not text.strip():
                    continue
                f.write(json.dumps({"text": text}) + "\n")
                texts.append(text)
                total += len(text.encode())
            if total >= max_bytes:
                break
    return texts


def _cpu_seconds() -> float:
    """CPU time of this process (all threads) plus its finished child processes."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def bench_preprocess(work: Path, corpus_mb: float = 8.0, vocab: int = 8000, repeats: int = 3) -> None:
    path = work / "stdlib.jsonl"
    texts = stdlib_corpus(path, int(corpus_mb * 1e6))
    nbytes = sum(len(t.encode()) for t in texts)
    t0 = time.perf_counter()
    model = train_sentencepiece([path], work / "bpe", vocab_size=vocab, input_sentence_size=40_000,
                                num_threads=2)
    print(f"corpus: {len(texts)} docs, {nbytes / 1e6:.1f} MB of stdlib sources; trained SentencePiece BPE "
          f"vocab {vocab} in {time.perf_counter() - t0:.1f} s")
    sp = spm.SentencePieceProcessor(model_file=model)
    for workers in (1, 2):
        wall = {"raw": [], "ours": []}
        cpu = {"raw": [], "ours": []}
        for r in range(repeats):
            c, t = _cpu_seconds(), time.perf_counter()
            sp.encode(texts, num_threads=workers)
            wall["raw"].append(time.perf_counter() - t)
            cpu["raw"].append(_cpu_seconds() - c)
            cfg = PreprocessConfig(input=[str(path)], output_prefix=str(work / f"out{workers}_{r}"),
                                   tokenizer_model=model, workers=workers, append_eod=True,
                                   partition_bytes=max(nbytes // 8, 1 << 16))
            c, t = _cpu_seconds(), time.perf_counter()
            run_preprocess(cfg)
            wall["ours"].append(time.perf_counter() - t)
            cpu["ours"].append(_cpu_seconds() - c)
        raw_mbs, our_mbs = nbytes / min(wall["raw"]) / 1e6, nbytes / min(wall["ours"]) / 1e6
        cpu_ratio = min(cpu["raw"]) / min(cpu["ours"])
        print(f"workers={workers}: raw encode(list, num_threads={workers}) {raw_mbs:.2f} MB/s | run_preprocess "
              f"{our_mbs:.2f} MB/s | wall ratio {our_mbs / raw_mbs:.3f}, CPU-time ratio {cpu_ratio:.3f} "
              f"(target >= 0.85; best of {repeats})")
    a = Path(work / "out1_0_text_document.bin").read_bytes()
    b = Path(work / "out2_0_text_document.bin").read_bytes()
    print(f"outputs of 1 and 2 workers byte-identical: {a == b}")


def bench_access(work: Path, gigabytes: float = 1.0, seq: int = 2048, n: int = 2000) -> None:
    prefix = work / "big"
    num_tokens = int(gigabytes * 2**30) // 2
    rng = np.random.default_rng(0)
    lengths = rng.integers(200, 3000, size=num_tokens // 1600).astype(np.int32)
    lengths[-1] += num_tokens - int(lengths.sum())
    t = time.perf_counter()
    with IndexedDatasetBuilder(prefix, np.uint16, durable=False) as b:
        for s in range(0, len(lengths), 20_000):
            lens = lengths[s:s + 20_000]
            b.add_batch(rng.integers(0, 32000, size=int(lens.sum()), dtype=np.uint16), lens)
    ds = IndexedDataset(prefix)
    ds.verify()
    print(f"synthetic dataset: {os.path.getsize(f'{prefix}.bin') / 2**30:.2f} GiB, {len(ds)} docs, "
          f"written in {time.perf_counter() - t:.1f} s")
    g = GPTDataset(ds, (0, ds.num_documents), None, GPTDatasetConfig(seq_length=seq, seed=1), "train")
    raw = np.memmap(f"{prefix}.bin", dtype=np.uint16, mode="r")
    idx = rng.integers(0, len(g), size=n)
    offs = rng.integers(0, len(raw) - seq - 1, size=n)
    lat_g, lat_r = [], []
    for i, o in zip(idx, offs):
        t = time.perf_counter()
        g[int(i)]
        lat_g.append(time.perf_counter() - t)
        t = time.perf_counter()
        np.array(raw[o:o + seq + 1], dtype=np.int64)
        lat_r.append(time.perf_counter() - t)
    pg, pr = np.percentile(lat_g, [50, 99]) * 1e6, np.percentile(lat_r, [50, 99]) * 1e6
    print(f"random __getitem__ seq {seq}: p50 {pg[0]:.0f} us, p99 {pg[1]:.0f} us | bare memmap copy p50 "
          f"{pr[0]:.0f} us, p99 {pr[1]:.0f} us | p50 ratio {pg[0] / pr[0]:.2f}x")
    t = time.perf_counter()
    m = min(len(g), 5000)
    for i in range(m):
        g.sample_tokens(i)
    seq_rate = m / (time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(m):
        np.array(raw[i * seq:i * seq + seq + 1], dtype=np.int64)
    raw_rate = m / (time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(m):
        g[i]
    full_rate = m / (time.perf_counter() - t)
    print(f"sequential: {seq_rate:.0f} samples/s (tokens only), {full_rate:.0f} samples/s (shuffled, with "
          f"masks) | bare memmap {raw_rate:.0f} samples/s | ratio {seq_rate / raw_rate:.2f}")


def bench_index(docs: int = 10_000_000, seq: int = 2048) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2000, size=docs).astype(np.int32)
    t = time.perf_counter()
    ref = np.cumsum(lengths, dtype=np.int64)
    np.searchsorted(ref, np.arange(0, int(ref[-1]), seq))
    t_ref = time.perf_counter() - t
    t = time.perf_counter()
    out = build_gpt_indices(lengths, 0, seq, None, seed=1234)
    dt = time.perf_counter() - t
    print(f"index build: {lengths.sum() / 1e9:.2f} B tokens, {docs} docs, seq {seq}: {dt:.1f} s "
          f"(target < 60 s; {len(out['shuffle_index'])} samples) | bare cumsum+searchsorted {t_ref:.1f} s | "
          f"ratio {dt / t_ref:.1f}x")


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        work = Path(tmp)
        if what in ("preprocess", "all"):
            bench_preprocess(work)
        if what in ("access", "all"):
            bench_access(work)
        if what in ("index", "all"):
            bench_index()


if __name__ == "__main__":
    main()
