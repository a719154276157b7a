"""The T5 family: encoder-decoder models (T5 v1.0 / v1.1), their presets and their Hugging Face adapter (``hf``)."""

from __future__ import annotations

from mg_models.lazy import lazy_exports

_EXPORTS = {  # name -> its module (see mg_models.lazy)
    "T5Model": "model",
    "T5DecoderCache": "model",
    "greedy_generate": "model",
    "load_hf_t5": "family",
    "relative_position_bucket": "model",
    "T5Config": "config",
    "T5_PRESETS": "config",
    "get_t5_config": "config",
    "T5Family": "family",
}


__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
