"""Prompt processing and decoding speed of mg's generate vs Hugging Face ``generate`` (CPU, same model).

A randomly initialised Hugging Face model (Llama or GPT-2 shape) is saved, loaded into mg with
``load_pretrained``, and both generate greedily from the same prompts (same dtype, lengths,
batch). Prefill = one forward over the prompts; decode = new tokens/s of the whole generate
call after subtracting the prefill. Runs alternate (HF, mg, HF, mg, ...) and the fastest is
reported; tokens are checked to be identical.

    .venv/bin/python benchmarks/bench_generate.py [--arch llama|gpt2] [--new 32] [--reps 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings

import torch

from mg_models import load_pretrained
from mg_models.generation import SamplingConfig, generate


def build_hf(arch: str):
    import transformers

    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                                       num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024)
        return transformers.LlamaForCausalLM(cfg).eval()
    cfg = transformers.GPT2Config(vocab_size=8192, n_embd=384, n_layer=6, n_head=6, n_positions=1024,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=["llama", "gpt2"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both sides (1 keeps small decode matmuls stable on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    hf = build_hf(args.arch)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d, safe_serialization=True)
        mg = load_pretrained(d)
    ids = torch.randint(0, 8192, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    prompts = ids.tolist()
    cfg = SamplingConfig(max_new_tokens=args.new)

    def hf_prefill():
        return hf(ids, attention_mask=mask, use_cache=True).logits

    def mg_prefill():
        from mg_models.generation import InferenceCache

        return mg(ids, inference_cache=InferenceCache(args.batch, args.prompt))

    def hf_generate():
        return hf.generate(ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                           do_sample=False, pad_token_id=0)[:, args.prompt:].tolist()

    def mg_generate():
        return generate(mg, prompts, cfg).tokens

    times: dict[str, list[float]] = {k: [] for k in ("hf_prefill", "mg_prefill", "hf_gen", "mg_gen")}
    with torch.no_grad():
        hf_generate(), mg_generate()  # warm up
        for _ in range(args.reps):
            times["hf_prefill"].append(timed(hf_prefill)[1])
            times["mg_prefill"].append(timed(mg_prefill)[1])
            hf_tokens, t = timed(hf_generate)
            times["hf_gen"].append(t)
            mg_tokens, t = timed(mg_generate)
            times["mg_gen"].append(t)
    # Fastest run of each: on a shared machine slower runs measure foreign load, not the code.
    med = {k: min(v) for k, v in times.items()}
    prompt_tokens, new_tokens = args.batch * args.prompt, args.batch * args.new
    res = {
        "hf_prefill": prompt_tokens / med["hf_prefill"], "mg_prefill": prompt_tokens / med["mg_prefill"],
        "hf_decode": new_tokens / max(med["hf_gen"] - med["hf_prefill"], 1e-9),
        "mg_decode": new_tokens / max(med["mg_gen"] - med["mg_prefill"], 1e-9),
    }
    print(f"arch={args.arch} fp32 threads={torch.get_num_threads()} batch={args.batch} prompt={args.prompt} "
          f"new={args.new} reps={args.reps} (fastest run of each)")
    print("| phase | HF tokens/s | mg tokens/s | mg / HF |")
    print("|---|---|---|---|")
    for phase in ("prefill", "decode"):
        print(f"| {phase} | {res['hf_' + phase]:.0f} | {res['mg_' + phase]:.0f} | "
              f"{res['mg_' + phase] / res['hf_' + phase]:.2f} |")
    total_ratio = med["hf_gen"] / med["mg_gen"]
    print(f"| whole generate (prompt + {args.new} new) | {new_tokens / med['hf_gen']:.0f} | "
          f"{new_tokens / med['mg_gen']:.0f} | {total_ratio:.2f} |")
    print(f"greedy tokens identical: {hf_tokens == mg_tokens}")


if __name__ == "__main__":
    main()
