"""GPT (GPT-2 and Llama styles), BERT and T5 built on mg-parallel layers, with Hugging Face interoperability and generation."""

__version__ = "0.1.0"

from mg_models.config import GPTConfig, check_parallel  # noqa: E402
from mg_models.flops import flops_per_token, num_parameters  # noqa: E402
from mg_models.gpt.presets import get_config, list_presets  # noqa: E402


def __getattr__(name: str):
    # Heavier modules (parallel layers, safetensors) load on first use so `import mg_models` stays cheap.
    lazy = {
        "GPTModel": "mg_models.gpt",
        "load_pretrained": "mg_models.pretrained",
        "load_model": "mg_models.loading",
        "register_checkpoint_loader": "mg_models.pretrained",
        "generate": "mg_models.generation",
        "generate_seq2seq": "mg_models.generation",
        "model_from_state": "mg_models.pretrained",
        "SamplingConfig": "mg_models.generation",
        "InferenceCache": "mg_models.generation",
        "BertConfig": "mg_models.bert",
        "BertModel": "mg_models.bert",
        "T5Config": "mg_models.t5",
        "T5Model": "mg_models.t5",
    }
    if name in lazy:
        import importlib

        return getattr(importlib.import_module(lazy[name]), name)
    raise AttributeError(f"module 'mg_models' has no attribute {name!r}")


__all__ = [
    "BertConfig",
    "BertModel",
    "GPTConfig",
    "GPTModel",
    "InferenceCache",
    "SamplingConfig",
    "T5Config",
    "T5Model",
    "check_parallel",
    "flops_per_token",
    "generate",
    "generate_seq2seq",
    "get_config",
    "list_presets",
    "load_model",
    "load_pretrained",
    "model_from_state",
    "num_parameters",
    "register_checkpoint_loader",
]
