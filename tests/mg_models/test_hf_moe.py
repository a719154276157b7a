"""Mixture-of-experts GPT and Mixtral / Qwen2-MoE / Qwen3-MoE <-> mg: logits, greedy generations, export round trip,
training, config checks, parameter and FLOP counts (fp32, CPU, one process).

Randomly initialised Hugging Face models are the reference; their router weights are scaled up so that
tokens spread over all four experts (HF initialises Qwen's routers to zero: every token would tie).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mg_models import GPTConfig, GPTModel, flops_per_token, get_config, load_pretrained, num_parameters
from mg_models.generation import SamplingConfig, generate
from mg_models.hf import config_from_hf, config_to_hf, read_hf_directory, write_hf_directory
from mg_parallel.moe import GroupedExperts, TopKRouter, is_expert_param, moe_losses
from mg_parallel.testing import run_distributed

from .test_hf_parity import assert_exports_bit_exact, save_case

VOCAB = 301
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, rms_norm_eps=1e-5, num_experts_per_tok=2)
CASES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SHAPE, intermediate_size=48, num_local_experts=4)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(  # dense first layer
        **SHAPE, intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=80, num_experts=4,
        mlp_only_layers=[0], tie_word_embeddings=True)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SHAPE, intermediate_size=96, moe_intermediate_size=48, num_experts=4, head_dim=24, norm_topk_prob=True)),
}
MOE_FIELDS = dict(position_embedding="rope", normalization="rmsnorm", activation="swiglu", add_bias_linear=False)


def _random_routers(hf):
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):  # routers: non-trivial routing
                p.copy_(torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request, tmp_path_factory):
    return save_case(request.param, CASES[request.param], tmp_path_factory, _random_routers)


def test_logits_match_with_every_expert_used(saved):
    name, hf, path = saved
    model = load_pretrained(path)
    chosen = []
    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.register_forward_hook(lambda mod, args, out: chosen.append(out[1]))
    ids = torch.randint(0, VOCAB, (3, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids)
    assert (out - ref).abs().max().item() <= 1e-5, name
    assert chosen and all(torch.bincount(c.flatten(), minlength=4).min() > 0 for c in chosen), name
    assert model.config.moe_layer_pattern == ([0, 1] if name == "qwen2_moe" else [1, 1])


def test_greedy_generation_matches(saved):
    name, hf, path = saved
    model = load_pretrained(path)
    prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    new = 10
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, pad_token_id=0)
    assert generate(model, prompt.tolist(), SamplingConfig(max_new_tokens=new)).tokens == ref[:, 7:].tolist(), name


def test_export_round_trip_is_bit_exact(saved, tmp_path):
    name, hf, path = saved
    _, state, model_type = assert_exports_bit_exact(path, hf, tmp_path, 9, name)
    assert model_type == name and state["decoder.layers.1.mlp.experts.w1"].shape == (4, 64, 2, 48)


def test_mg_moe_model_exports_to_qwen2_moe(tmp_path):
    """A model built by mg (its own init, a dense first layer, a gated shared expert) exports with the same logits."""
    config = get_config("tiny-moe", vocab_size=VOCAB, moe_layer_freq=[0, 1], moe_router_pre_softmax=True,
                        add_qkv_bias=True, moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)
    model = GPTModel(config, seed=7).eval()
    with torch.no_grad():
        model.decoder.layers["1"].mlp.router.weight.mul_(50)  # mg's router init is small too
    write_hf_directory(tmp_path, model.state_dict(), config, "qwen2_moe")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "Qwen2MoeForCausalLM"
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (model(ids, gather_logits=True) - hf(ids).logits).abs().max().item() <= 1e-5


def test_moe_gpt_trains_with_a_dense_first_layer():
    config = get_config("tiny-moe", vocab_size=200, moe_layer_freq=[0, 1], moe_z_loss_coeff=1e-3)
    model = GPTModel(config, seed=3)
    assert type(model.decoder.layers["0"].mlp).__name__ == "MLP"
    assert type(model.decoder.layers["1"].mlp).__name__ == "MoEMLP"
    assert num_parameters(config) == sum(p.numel() for p in model.parameters()) - (256 - 200) * 64 * 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 200, (4, 16), generator=torch.Generator().manual_seed(6))
    losses = []
    for _ in range(3):
        loss = model(ids, labels=ids).mean()
        opt.zero_grad()
        loss.backward()
        aux = moe_losses(model)
        assert set(aux) == {"load_balancing_loss", "z_loss"} and all(torch.isfinite(v) for v in aux.values())
        mlp = model.decoder.layers["1"].mlp
        assert mlp.router.weight.grad.abs().sum() > 0 and mlp.experts.w1.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_same_seed_same_experts_and_routing_layout():
    """Expert weights derive from (seed, name): two builds agree, and w1 and w2 differ in their draws."""
    config = get_config("tiny-moe")
    a, b = GPTModel(config, seed=5).state_dict(), GPTModel(config, seed=5).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    w1, w2 = a["decoder.layers.0.mlp.experts.w1"], a["decoder.layers.0.mlp.experts.w2"]
    assert w1.std().item() == pytest.approx(0.02, rel=0.1) and w2.std().item() < w1.std().item()
    assert not torch.equal(a["decoder.layers.0.mlp.router.weight"], a["decoder.layers.1.mlp.router.weight"])


def test_presets_and_counts():
    assert num_parameters(get_config("mixtral-8x7b")) == 46_702_792_704  # published
    assert num_parameters(get_config("mixtral-8x7b"), active=True) == 12_879_925_248
    assert 30.4e9 < num_parameters(get_config("qwen3-30b-a3b")) < 30.6e9
    assert 3.2e9 < num_parameters(get_config("qwen3-30b-a3b"), active=True) < 3.4e9
    # top-2 of 4 experts of width 64 (and a router) cost less than tiny-llama's one MLP of width 160
    assert flops_per_token(get_config("tiny-moe"), 24) < flops_per_token(get_config("tiny-llama"), 24)
    config = get_config("tiny-moe", vocab_size=256, moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = GPTModel(config)
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.path = "loop"  # one matmul per expert: what the counter sees
    ids = torch.randint(0, 256, (2, 24))
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(ids, labels=ids).sum().backward()
    assert flops_per_token(config, 24, padded_vocab=True) == counter.get_total_flops() / 48


def test_config_errors_name_the_key():
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, **MOE_FIELDS)
    for fields, message in [
        (dict(moe_router_topk=4), r"model.moe_router_topk needs model.num_experts"),
        (dict(num_experts=0), r"model.num_experts must be a positive integer"),
        (dict(num_experts=4, moe_router_topk=5), r"model.moe_router_topk=5 exceeds model.num_experts=4"),
        (dict(num_experts=4, moe_layer_freq=[0, 1, 1]), r"model.moe_layer_freq=\[0, 1, 1\] must list 0 \(dense\) or 1"),
        (dict(num_experts=4, moe_layer_freq=0), r"model.moe_layer_freq=0 must be a positive integer"),
        (dict(num_experts=4, moe_router_score_function="relu"), r"model.moe_router_score_function='relu'"),
        (dict(num_experts=4, moe_shared_expert_gate=True), r"model.moe_shared_expert_gate needs "
                                                           r"model.moe_shared_expert_intermediate_size"),
        (dict(num_experts=4, moe_aux_loss_coeff=-1.0), r"model.moe_aux_loss_coeff must be >= 0"),
        (dict(num_experts=4, add_bias_linear=True), r"model.add_bias_linear=True is not supported with"),
        (dict(num_experts=4, activation="gelu_tanh"), r"model.activation='gelu_tanh' is not available for experts"),
    ]:
        with pytest.raises(ValueError, match=message):
            GPTConfig(**{**base, **fields})
    assert GPTConfig(**base, num_experts=4, moe_layer_freq=2).moe_layer_pattern == [1, 0]


def test_export_refusals_name_the_fields():
    moe = get_config("tiny-moe")
    with pytest.raises(ValueError, match=r"cannot be exported as 'llama'; use model_type 'mixtral'"):
        config_to_hf(moe, "llama")
    with pytest.raises(ValueError, match=r"Qwen2Moe export needs model.moe_router_pre_softmax=True; a shared expert"):
        config_to_hf(moe, "qwen2_moe")
    with pytest.raises(ValueError, match=r"Mixtral export needs model.moe_expert_capacity_factor=null"):
        config_to_hf(get_config("tiny-moe", moe_expert_capacity_factor=1.0), "mixtral")
    with pytest.raises(ValueError, match=r"Mixtral export needs every layer an MoE layer"):
        config_to_hf(get_config("tiny-moe", moe_layer_freq=[0, 1]), "mixtral")
    with pytest.raises(ValueError, match=r"Qwen3Moe export needs model.num_experts"):
        config_to_hf(get_config("tiny-llama"), "qwen3_moe")
    hf = {"model_type": "qwen2_moe", **SHAPE, "intermediate_size": 96, "moe_intermediate_size": 48,
          "shared_expert_intermediate_size": 80, "num_experts": 4}
    with pytest.raises(ValueError, match=r"use_sliding_window=True is not supported for qwen2_moe"):
        config_from_hf({**hf, "use_sliding_window": True})
    with pytest.raises(ValueError, match=r"decoder_sparse_step=3 with mlp_only_layers=\[\] leaves no MoE layer"):
        config_from_hf({**hf, "decoder_sparse_step": 3})
    assert config_from_hf({**hf, "decoder_sparse_step": 2}).moe_layer_pattern == [0, 1]


LAYOUTS = {  # name: (ParallelDims fields, experts see both ranks' tokens)
    "ep2": (dict(ep=2), True),
    "tp2-sp": (dict(tp=2, sequence_parallel=True), False),  # each tp rank routes its s/tp tokens
    "etp2-sp": (dict(tp=2, etp=2, sequence_parallel=True), False),  # each expert's FFN split over tp
}


def _global(t: torch.Tensor, p: torch.nn.Parameter, grid) -> torch.Tensor:
    """The global tensor of this rank's ``t`` (of parameter ``p``): experts gathered over ep, shards over tp."""
    import torch.distributed as dist

    for split, group, dim in ((is_expert_param(p) and grid.ep_size > 1, grid.ep_group, 0),
                              (getattr(p, "tensor_parallel", False), grid.tp_group, getattr(p, "partition_dim", 0))):
        if split:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=dim)
    return t.clone()


def layout_worker() -> dict[str, object]:
    """On 2 ranks, every rank fed the same batch: each layout of LAYOUTS, its global parameters and gradients."""
    from mg_parallel.grid import ParallelDims, build_grid
    from mg_parallel.tensor_parallel import allreduce_sequence_parallel_grads

    torch.set_num_threads(1)
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(8))
    out: dict[str, object] = {}
    for name, (dims, _) in LAYOUTS.items():
        grid = build_grid(ParallelDims(**dims))
        model = GPTModel(get_config("tiny-moe", vocab_size=200), grid, seed=9,
                         sequence_parallel=dims.get("sequence_parallel", False))
        loss = model(ids, labels=ids)
        loss.sum().backward()
        if grid.tp_size > 1:
            allreduce_sequence_parallel_grads(model, grid.tp_group)
        out[name] = {"loss": loss.detach(), "params": {n: _global(p.detach(), p, grid) for n, p in
                                                       model.named_parameters()},
                     "grads": {n: _global(p.grad, p, grid) for n, p in model.named_parameters()}}
    return out


def test_expert_and_tensor_parallel_models_equal_one_process():
    config = get_config("tiny-moe", vocab_size=200)
    ref = GPTModel(config, seed=9)
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(8))
    ref_loss = ref(ids, labels=ids)
    ref_loss.sum().backward()
    for rank_out in run_distributed(layout_worker, 2):
        for name, (_, both_ranks_tokens) in LAYOUTS.items():
            res = rank_out[name]
            torch.testing.assert_close(res["loss"], ref_loss.detach(), atol=1e-5, rtol=1e-5, msg=name)
            for n, p in ref.named_parameters():
                assert torch.equal(res["params"][n], p.detach()), (name, n)  # the same global tensors
                # At ep=2 both ranks' tokens reach each expert: twice the gradient of one copy of the batch.
                scale = 2 if both_ranks_tokens and is_expert_param(p) else 1
                torch.testing.assert_close(res["grads"][n], scale * p.grad, atol=1e-5, rtol=1e-4, msg=f"{name} {n}")


def test_streaming_conversion_plans_the_expert_tensors_on_meta():
    """converted_specs (shapes from headers, meta tensors) gives per-expert Hugging Face tensors and back."""
    from mg_models.hf import converted_specs, tensor_groups

    config = get_config("tiny-moe", moe_router_pre_softmax=True, moe_layer_freq=[0, 1],
                        moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)
    state = GPTModel(config).state_dict()
    groups = tensor_groups(config, "qwen2_moe")
    assert max(len(g.hf) for g in groups) == 2 * config.num_experts  # one layer's gate+up weights
    hf = {n: (s, d) for n, s, d in converted_specs(groups, lambda n: (state[n].shape, state[n].dtype), "hf")}
    assert hf["model.layers.1.mlp.experts.3.down_proj.weight"] == ((64, 64), torch.float32)
    assert hf["model.layers.1.mlp.shared_expert.gate_proj.weight"][0] == (32, 64)
    back = converted_specs(groups, lambda n: hf[n], "mg")
    assert {n: s for n, s, _ in back} == {n: tuple(t.shape) for n, t in state.items()}


def test_fused_experts_of_a_loaded_model_convert_alike(saved, tmp_path):
    """transformers 5.x's in-memory state dict (experts.gate_up_proj [N, 2f, h]) and a save_original_format=False
    directory give the same mg state as the checkpoint's per-expert tensors."""
    from mg_models.hf import state_from_hf

    name, hf, path = saved
    config, state, _ = read_hf_directory(path)
    memory = hf.state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in memory)
    fused = state_from_hf(memory, config, name)
    assert sorted(fused) == sorted(state) and all(torch.equal(fused[k], v) for k, v in state.items())
    hf.save_pretrained(tmp_path, save_original_format=False)
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(str(tmp_path / "model.safetensors")))
    again = read_hf_directory(tmp_path)[1]
    assert all(torch.equal(again[k], v) for k, v in state.items())
