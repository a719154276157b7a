"""RoPE scaling (linear, dynamic NTK, Llama 3.1, YaRN): config checks, Hugging Face parity beyond the original
context (fp32), export round trip, and fp32 angles at 131072 positions against a float64 formula."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mg_models import GPTConfig, GPTModel, load_pretrained
from mg_models.generation import SamplingConfig, generate
from mg_models.hf import config_from_hf, read_hf_directory, write_hf_directory
from mg_models.layers import RotaryEmbedding

VOCAB = 301
ORIGINAL = 16  # the "pretraining" context of the tiny models; the tests run past it
LLAMA31 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
SCALINGS = {  # Hugging Face rope_parameters, max_position_embeddings
    "llama3": ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}, 8 * ORIGINAL),
    "yarn": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
              "original_max_position_embeddings": ORIGINAL}, 4 * ORIGINAL),
    "yarn-mscale": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 16, "beta_slow": 2,
                     "mscale": 0.707, "mscale_all_dim": 1.0, "original_max_position_embeddings": ORIGINAL},
                    4 * ORIGINAL),
    "linear": ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, ORIGINAL),
    "dynamic": ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}, ORIGINAL),
}


def _shape(**fields) -> GPTConfig:
    return GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                     position_embedding="rope", **fields)


@pytest.mark.parametrize("scaling, message", [
    ({"type": "longrope", "factor": 2.0}, r"model.rotary_scaling.type='longrope'; use one of"),
    ({"factor": 2.0}, r"model.rotary_scaling.type=None"),
    ({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
     r"missing model.rotary_scaling.high_freq_factor, model.rotary_scaling.original_max_position_embeddings"),
    ({"type": "linear", "factor": 2.0, "beta_fast": 3}, r"unknown parameter\(s\) \['beta_fast'\] for type 'linear'"),
    ({"type": "linear", "factor": -2.0}, r"model.rotary_scaling.factor=-2.0 must be a positive number"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8.5},
     r"original_max_position_embeddings=8.5 must be a positive integer"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "truncate": "no"},
     r"model.rotary_scaling.truncate='no' must be true or false"),
    ({**LLAMA31, "high_freq_factor": 1.0}, r"high_freq_factor=1.0 must exceed model.rotary_scaling.low_freq_factor"),
    ("llama3", r"model.rotary_scaling must be a mapping"),
])
def test_bad_scaling_names_the_parameter(scaling, message):
    with pytest.raises(ValueError, match=message):
        _shape(rotary_scaling=scaling)


def test_scaling_needs_rope_and_round_trips_as_a_dict():
    with pytest.raises(ValueError, match=r"model.rotary_scaling needs model.position_embedding='rope'"):
        GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                  rotary_scaling={"type": "linear", "factor": 2.0})
    config = _shape(rotary_scaling={"factor": 8, "type": "llama3", "low_freq_factor": 1, "high_freq_factor": 4,
                                    "original_max_position_embeddings": 8192})
    assert config.rotary_scaling == LLAMA31 and list(config.rotary_scaling)[0] == "type"
    assert isinstance(config.rotary_scaling["factor"], float)
    assert GPTConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


# ------------------------------------------------------------------------------ Hugging Face parity


def _hf_llama(transformers, rope_parameters: dict, max_positions: int, **extra) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                                   rope_parameters=dict(rope_parameters), rms_norm_eps=1e-5, **extra)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def transformers():
    import transformers

    return transformers


def _save(name, transformers, tmp_path_factory):
    rope_parameters, max_positions = SCALINGS[name]
    hf = _hf_llama(transformers, rope_parameters, max_positions)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path, safe_serialization=True)
    return name, hf, path


@pytest.fixture(scope="module", params=sorted(SCALINGS))
def saved(request, transformers, tmp_path_factory):
    return _save(request.param, transformers, tmp_path_factory)


def test_logits_match_beyond_the_original_context(saved):
    name, hf, path = saved
    model = load_pretrained(path)
    plain = GPTModel(GPTConfig(**{**model.config.to_dict(), "rotary_scaling": None})).eval()
    plain.load_state_dict(model.state_dict())
    # Dynamic scaling is plain rotary within the original context (12) and grows its base beyond it (40); ascending,
    # since Hugging Face's dynamic scaling keeps the longest length seen.
    for length in (12, 40) if name == "dynamic" else (40,):
        ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            ref = hf(ids).logits
            out = model(ids)
            unscaled = plain(ids, gather_logits=True)
        assert (out - ref).abs().max().item() <= 1e-5, (name, length)
        if length > ORIGINAL:  # the scaling is in effect, not a no-op
            assert (unscaled - ref).abs().max().item() > 1e-3, (name, length)


# The logits test covers every type; decoding adds a per-step base (dynamic) and the cache crossing the context.
@pytest.mark.parametrize("name", ["dynamic", "llama3"])
def test_greedy_generation_past_the_original_context(name, transformers, tmp_path_factory):
    """Incremental decoding with the KV cache crosses the original context (dynamic: the base grows per step)."""
    _, hf, path = _save(name, transformers, tmp_path_factory)
    hf = type(hf).from_pretrained(path).eval()  # fresh: dynamic scaling in Hugging Face is stateful
    model = load_pretrained(path)
    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False, pad_token_id=0)
    assert generate(model, prompt.tolist(), SamplingConfig(max_new_tokens=12)).tokens == ref[:, 10:].tolist(), name


def test_export_round_trip(saved, transformers, tmp_path):
    name, hf, path = saved
    config, state, model_type = read_hf_directory(path)
    out = write_hf_directory(tmp_path, state, config, model_type)
    original = json.loads((path / "config.json").read_text())["rope_parameters"]
    exported = json.loads((out / "config.json").read_text())
    assert exported["rope_parameters"] == original and exported["rope_scaling"] == original, name
    assert config_from_hf(exported) == config
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits), name


def test_llama31_logits_at_positions_near_131072(transformers, tmp_path):
    """Llama 3.1's own rotary configuration, scored at the last positions of its 131072-token context."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0,
            **{k: v for k, v in LLAMA31.items() if k != "type"}}
    hf = _hf_llama(transformers, rope, 131072)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_pretrained(tmp_path)
    assert model.config.rotary_scaling == LLAMA31 and model.config.rotary_base == 500000.0
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    positions = (131072 - 12 + torch.arange(12)).expand(2, 12)
    with torch.no_grad():
        ref = hf(ids, position_ids=positions).logits
        out = model(ids, position_ids=positions)
    assert (out - ref).abs().max().item() <= 1e-5


def test_configs_of_transformers_4_and_refusals():
    base = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
            "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 4096}
    # transformers 4.x: rope_scaling with "type" (older) or "rope_type", rope_theta at the top level.
    old = config_from_hf({**base, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (old.rotary_base, old.rotary_scaling) == (1e6, {"type": "linear", "factor": 2.0})
    # llama3 without original_max_position_embeddings: the top-level one, else max_position_embeddings.
    partial = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    assert config_from_hf({**base, "rope_parameters": partial}).rotary_scaling[
        "original_max_position_embeddings"] == 4096
    assert config_from_hf({**base, "rope_parameters": partial, "original_max_position_embeddings": 1024}
                          ).rotary_scaling["original_max_position_embeddings"] == 1024
    # Parameters the type does not use are ignored, as Hugging Face ignores them.
    assert config_from_hf({**base, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "low_freq_factor": 1}}
                          ).rotary_scaling == {"type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match=r"rope_parameters.rope_type='longrope' is not supported"):
        config_from_hf({**base, "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0]}})
    with pytest.raises(ValueError, match=r"config.json: rope_scaling: model.rotary_scaling.factor=0"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "linear", "factor": 0}})


# ------------------------------------------------------------------------------ angles at long positions


def _inv_freq64(dim: int, base: float, scaling: dict | None) -> tuple[list[float], float]:
    """Scaled inverse frequencies and the cos/sin factor in float64, straight from the papers' definitions."""
    inv = [base ** (-2 * i / dim) for i in range(dim // 2)]
    if scaling is None:
        return inv, 1.0
    s, factor = scaling, scaling["factor"]
    original = s["original_max_position_embeddings"]
    if s["type"] == "llama3":
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < original / s["high_freq_factor"]:
                out.append(f)
            elif wavelen > original / s["low_freq_factor"]:
                out.append(f / factor)
            else:
                t = (original / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
                out.append((1 - t) * f / factor + t * f)
        return out, 1.0
    # YaRN: dimension d turns original / wavelength(d) times over the original context; more than beta_fast
    # turns keeps the frequency, fewer than beta_slow interpolates it, with a linear ramp between (in d).
    def dim_for(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(dim_for(32)), 0), min(math.ceil(dim_for(1)), dim - 1)
    ramp = [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(dim // 2)]
    return [f / factor * r + f * (1 - r) for f, r in zip(inv, ramp)], 0.1 * math.log(factor) + 1.0


@pytest.mark.parametrize("scaling", [None, LLAMA31, {"type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 32768}],
                         ids=["plain", "llama3", "yarn"])
def test_cos_sin_at_131072_positions_against_float64(scaling):
    dim, base, n = 8, 500000.0, 131072
    rope = RotaryEmbedding(dim, base, scaling=_shape(rotary_scaling=scaling).rotary_scaling,
                           max_position_embeddings=n)
    positions = torch.arange(n, dtype=torch.int64)[None]
    cos, sin = rope(positions)
    assert cos.shape == sin.shape == (n, 1, 1, dim) and cos.dtype == torch.float32
    assert torch.equal(rope(positions.int())[0], cos)  # int32 positions give the same angles
    inv64, factor = _inv_freq64(dim, base, scaling)
    inv64 = torch.tensor(inv64, dtype=torch.float64)
    inv32 = rope.inv_freq.double()
    torch.testing.assert_close(inv32, inv64, rtol=4e-7, atol=0)  # a few fp32 ulp
    assert rope.attention_factor == pytest.approx(factor, rel=1e-12)
    cos, sin = cos[:, 0, 0].double() / factor, sin[:, 0, 0].double() / factor
    assert torch.equal(cos[:, : dim // 2], cos[:, dim // 2:])
    # Angles are position * inv_freq rounded once to fp32 (as Hugging Face computes them), and cos/sin of those
    # angles are accurate to fp32 even at 131072 radians: no int overflow, no low-precision positions.
    pos = positions[0].double()[:, None]
    angle32 = (pos * inv32).float().double()  # the exact fp32 product (48 bits fit in a double)
    torch.testing.assert_close(cos[:, : dim // 2], angle32.cos(), atol=3e-7, rtol=0)
    torch.testing.assert_close(sin[:, : dim // 2], angle32.sin(), atol=3e-7, rtol=0)
    # Against the exact float64 angle the error is that one fp32 rounding of the angle and of inv_freq.
    exact = pos * inv64
    bound = exact * (4e-7 + 2.0 ** -24) + 3e-7
    assert ((cos[:, : dim // 2] - exact.cos()).abs() <= bound).all()
    assert ((sin[:, : dim // 2] - exact.sin()).abs() <= bound).all()


def test_tables_stay_fp32_when_the_model_is_cast():
    rope = RotaryEmbedding(8, 500000.0, scaling=LLAMA31, max_position_embeddings=131072)
    positions = torch.arange(131064, 131072)[None]
    cos, sin = rope(positions)
    rope.to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.bfloat16
    again = rope(positions)
    assert rope.inv_freq.dtype == torch.float32 and torch.equal(again[0], cos) and torch.equal(again[1], sin)
