"""GPT (GPT-2 and Llama styles), BERT and T5 built on mg-parallel layers, with Hugging Face interoperability and generation."""

__version__ = "0.1.0"
