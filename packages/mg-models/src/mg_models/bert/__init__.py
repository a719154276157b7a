"""The BERT family: a bidirectional encoder with masked-LM, binary and classification heads, its presets and its
Hugging Face adapter (``hf``)."""

from __future__ import annotations

from mg_models.lazy import lazy_exports

_EXPORTS = {  # name -> its module (see mg_models.lazy)
    "BertModel": "model",
    "BertLayer": "model",
    "load_hf_bert": "family",
    "BertConfig": "config",
    "BERT_PRESETS": "config",
    "get_bert_config": "config",
    "BertFamily": "family",
}


__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
