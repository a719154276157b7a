"""`mg convert` streams: converting a ~400 MiB Llama-style model both ways stays within a memory bound far
below the model's size (peak RSS of the `mg` process), and the round trip is bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

MiB = 1 << 20
BIG = {"vocab": 8192, "hidden": 1024, "ffn": 2816, "layers": 8, "heads": 16, "kv_heads": 4}
TINY = {"vocab": 256, "hidden": 64, "ffn": 128, "layers": 2, "heads": 4, "kv_heads": 2}


def _shapes(m: dict[str, int]) -> dict[str, dict[str, tuple[int, ...]]]:
    """Hugging Face Llama tensor shapes, grouped by the file they are stored in (one file per layer)."""
    h, f, v, d = m["hidden"], m["ffn"], m["vocab"], m["hidden"] // m["heads"]
    files = {"model-embed.safetensors": {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                         "lm_head.weight": (v, h)}}
    for i in range(m["layers"]):
        p = f"model.layers.{i}"
        files[f"model-layer{i}.safetensors"] = {
            f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (h, h), f"{p}.self_attn.k_proj.weight": (m["kv_heads"] * d, h),
            f"{p}.self_attn.v_proj.weight": (m["kv_heads"] * d, h), f"{p}.self_attn.o_proj.weight": (h, h),
            f"{p}.mlp.gate_proj.weight": (f, h), f"{p}.mlp.up_proj.weight": (f, h), f"{p}.mlp.down_proj.weight": (h, f),
        }
    return files


def _value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor stored under ``name``: seeded by the name, so the test can regenerate it to compare."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def _write_hf_llama(path: Path, m: dict[str, int]) -> tuple[int, int]:
    """A Hugging Face Llama directory written one layer file at a time; returns (total bytes, largest tensor bytes)."""
    path.mkdir()
    weight_map, total, largest = {}, 0, 0
    for fname, shapes in _shapes(m).items():
        tensors = {name: _value(name, shape) for name, shape in shapes.items()}
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * 4
            largest = max(largest, t.numel() * 4)
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": m["hidden"], "intermediate_size": m["ffn"], "num_hidden_layers": m["layers"],
        "num_attention_heads": m["heads"], "num_key_value_heads": m["kv_heads"], "vocab_size": m["vocab"],
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }))
    return total, largest


def _mg_peak_rss(tmp: Path, *args: str) -> int:
    """Run ``mg ARGS`` in a fresh interpreter and return its peak resident set size in bytes.

    The peak is the process's own ``VmHWM``, read by an exit handler: the ``ru_maxrss`` that
    ``wait4``/``getrusage`` report would include the forking test process's RSS.
    """
    report = tmp / "status.txt"
    code = (f"import atexit, runpy, sys; atexit.register(lambda: open({str(report)!r}, 'w').write("
            f"open('/proc/self/status').read())); sys.argv = ['mg', *{list(args)!r}]; "
            f"runpy.run_module('mg_cli.main', run_name='__main__')")
    # A fixed mmap threshold makes glibc hand freed tensor memory back to the OS at once, so the
    # peak measures what the converter holds, not what the allocator kept cached for reuse.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MiB), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mg {' '.join(args)} failed:\n{proc.stderr[-3000:]}"
    status = report.read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


def _convert_both_ways(root: Path, src: Path) -> tuple[int, int]:
    to_mg = _mg_peak_rss(root, "convert", "--from", "hf", "--input", str(src), "--output", str(root / "ckpt"), "--tp", "2")
    to_hf = _mg_peak_rss(root, "convert", "--to", "hf", "--input", str(root / "ckpt"), "--output", str(root / "back"))
    return to_mg, to_hf


def test_convert_streams_both_ways_within_memory_bound(tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "big").mkdir()
    _write_hf_llama(tmp_path / "tiny" / "hf", TINY)
    model_bytes, largest = _write_hf_llama(tmp_path / "big" / "hf", BIG)
    assert model_bytes > 380 * MiB and largest == 32 * MiB

    # The same commands on a tiny model measure everything that does not grow with the model
    # (interpreter, torch, mg's modules).
    base_to_mg, base_to_hf = _convert_both_ways(tmp_path / "tiny", tmp_path / "tiny" / "hf")
    to_mg, to_hf = _convert_both_ways(tmp_path / "big", tmp_path / "big" / "hf")
    # The memory limit: the baseline plus two of the largest tensor (one being converted, one
    # output) plus slack; a converter holding the model (or one 400 MiB output shard) exceeds it.
    limit = 2 * largest + 24 * MiB
    assert limit < model_bytes / 4
    print(f"model {model_bytes / MiB:.0f} MiB; peak RSS hf->mg {to_mg / MiB:.0f} MiB (tiny {base_to_mg / MiB:.0f}), "
          f"mg->hf {to_hf / MiB:.0f} MiB (tiny {base_to_hf / MiB:.0f}); allowed growth {limit / MiB:.0f} MiB")
    assert to_mg - base_to_mg < limit, f"hf->mg grew {(to_mg - base_to_mg) / MiB:.0f} MiB over the tiny model's peak"
    assert to_hf - base_to_hf < limit, f"mg->hf grew {(to_hf - base_to_hf) / MiB:.0f} MiB over the tiny model's peak"

    # Bit-exact round trip, with exactly the original names (read with safetensors itself).
    back = tmp_path / "big" / "back"
    weight_map = json.loads((back / "model.safetensors.index.json").read_text())["weight_map"]
    expected = {name: shape for shapes in _shapes(BIG).values() for name, shape in shapes.items()}
    assert sorted(weight_map) == sorted(expected)
    for fname in sorted(set(weight_map.values())):
        with safe_open(str(back / fname), framework="pt") as f:
            for name in f.keys():
                assert torch.equal(f.get_tensor(name), _value(name, expected[name])), name
    config = json.loads((back / "config.json").read_text())
    assert config["num_key_value_heads"] == BIG["kv_heads"] and config["intermediate_size"] == BIG["ffn"]
