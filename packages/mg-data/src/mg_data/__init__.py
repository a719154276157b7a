"""Megatron-compatible indexed datasets, fast preprocessing, sample datasets with cached indices, blending and a resumable sampler."""

__version__ = "0.1.0"
