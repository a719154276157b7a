"""FSDP over mg's models: every transformer layer is its own FSDP unit (GPT and BERT keep their layers in an
``nn.ModuleDict``, T5 in ``nn.ModuleList`` s), so a step gathers one layer at a time, not the whole model."""

from mg_parallel.testing import run_distributed


def units_worker() -> dict[str, tuple[int, int, float]]:
    from torch.distributed.fsdp import FSDPModule

    from mg_models import GPTConfig, GPTModel
    from mg_models.bert import BertConfig, BertModel
    from mg_models.t5 import T5Config, T5Model
    from mg_parallel.distributed import memory_bytes
    from mg_parallel.distributed.fsdp import FullyShardedChunk
    from mg_parallel.grid import ParallelDims, build_grid

    grid = build_grid(ParallelDims())
    small = dict(hidden_size=64, num_attention_heads=4, vocab_size=128, max_position_embeddings=32)
    models = {
        "gpt": (GPTModel(GPTConfig(num_layers=4, **small), grid, seed=0), 4),
        "moe gpt": (GPTModel(GPTConfig(num_layers=2, num_experts=4, moe_ffn_hidden_size=32, add_bias_linear=False,
                                            **small), grid, seed=0), 2),
        "bert": (BertModel(BertConfig(num_layers=3, **small), grid, seed=0), 3),
        "t5": (T5Model(T5Config(num_layers=2, num_decoder_layers=3, hidden_size=64, num_attention_heads=4,
                                vocab_size=128), grid, seed=0), 5),
    }
    out = {}
    for name, (model, layers) in models.items():
        full = sum(p.numel() * 4 for p in model.parameters())
        chunk = FullyShardedChunk(model, grid)
        units = sum(isinstance(m, FSDPModule) for m in chunk.module.modules())
        out[name] = (units, layers + 1, memory_bytes([chunk])["params"] / full)
    return out


def test_every_layer_is_an_fsdp_unit():
    for rank_out in run_distributed(units_worker, 2):
        for name, (units, want, share) in rank_out.items():
            assert units == want, f"{name}: {units} FSDP units, want one per layer and the root ({want})"
            assert abs(share - 0.5) < 0.02, f"{name}: each of 2 ranks holds {share:.3f} of the parameters"
