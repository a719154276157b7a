"""The mg command: train, preprocess, tokenizer, convert, generate, inspect, plot."""

__version__ = "0.1.0"
