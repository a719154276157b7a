"""Megatron-style tensor, sequence, pipeline and data parallelism, ZeRO optimizer and mixed precision for your own PyTorch model."""

__version__ = "0.1.0"
