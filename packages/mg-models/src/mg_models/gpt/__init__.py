"""The GPT family: decoder-only language models (GPT-2, Llama, Mistral, Qwen, and their mixture-of-experts
variants), with their presets and Hugging Face adapters (``hf_gpt2``, ``hf_llama``, ``hf_moe``)."""

from __future__ import annotations

from mg_models.lazy import lazy_exports

_EXPORTS = {  # name -> its module (see mg_models.lazy)
    "GPTModel": "model",
    "GPTEmbedding": "model",
    "build_attention_mask": "model",
    "context_parallel_inputs": "model",
    "document_position_ids": "model",
    "PRESETS": "presets",
    "get_config": "presets",
    "list_presets": "presets",
    "GPTFamily": "family",
    "ParallelLMHead": "mg_models.heads",
    "WORD_EMBEDDING": "mg_models.heads",
    "GPTConfig": "mg_models.config",
}


__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
