"""Sharded safetensors checkpoints that reshard on load, save atomically and asynchronously, and never unpickle."""

__version__ = "0.1.0"
