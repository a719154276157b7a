"""Incremental decoding with a KV cache: greedy, temperature, top-k, top-p, stop tokens.

:func:`generate` continues prompts with a decoder-only model (GPT); :func:`generate_seq2seq` runs
an encoder-decoder model (T5) on source texts and decodes the targets, with the same sampling.

Prompts of different lengths are left-padded into one batch; an attention mask hides the padding
and position ids count real tokens only, so each row decodes exactly as it would alone. The
cache holds this rank's key/value heads, and logits are gathered over the tp group before
sampling, so every tp rank draws the same tokens (same seed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mg_models.stage import PipelineStageModel

__all__ = ["GenerationOutput", "InferenceCache", "SamplingConfig", "generate", "generate_seq2seq", "sample_next"]


class InferenceCache:
    """Per-layer key/value buffers ``[b, groups/tp, max_length, d]`` plus the number of cached positions.

    Buffers are allocated on first use with the dtype/device of the keys.
    """

    def __init__(self, batch_size: int, max_length: int) -> None:
        self.batch_size = batch_size
        self.max_length = max_length
        self.offset = 0
        """Positions already cached (the next token's position for unpadded rows)."""
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [b, g, s, d] at positions offset..offset+s and return all cached [b, g, offset+s, d].

        Raises:
            ValueError: the cache would exceed ``max_length``.
        """
        s = k.shape[2]
        end = self.offset + s
        if end > self.max_length:
            raise ValueError(f"inference cache holds {self.max_length} positions, {end} needed; "
                             f"build InferenceCache with a larger max_length")
        if layer not in self._kv:
            shape = (k.shape[0], k.shape[1], self.max_length, k.shape[3])
            self._kv[layer] = (k.new_empty(shape), v.new_empty(shape))
        kb, vb = self._kv[layer]
        kb[:, :, self.offset:end] = k
        vb[:, :, self.offset:end] = v
        return kb[:, :, :end], vb[:, :, :end]

    def advance(self, n: int, last_stage: bool = True) -> None:
        """Mark ``n`` more positions as cached (called by the model after each forward)."""
        self.offset += n


@dataclass(kw_only=True)
class SamplingConfig:
    """How to pick tokens."""

    max_new_tokens: int = 32
    """Upper bound on generated tokens per prompt."""
    temperature: float = 0.0
    """0 = greedy (argmax); otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (1.0 = off)."""
    stop_token_ids: Sequence[int] = ()
    """A row stops after producing one of these (the stop token is included in its output)."""
    pad_token_id: int = 0
    """Id used for left padding (any valid id; padding is masked)."""
    seed: int = 0
    """Sampling seed (the same on every tp rank, so they agree)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k={self.top_k} must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1]")


@dataclass
class GenerationOutput:
    """Generated continuations (prompt excluded), one list per prompt."""

    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    """Log-probability of each generated token under the model (before temperature/top-k/top-p)."""


def sample_next(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row from logits [b, V] -> ids [b]."""
    if config.temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / config.temperature
    if config.top_k > 0:
        k = min(config.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already reach top_p (the first always survives).
        drop = (probs.cumsum(-1) - probs) >= config.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], config: SamplingConfig | None = None,
             ) -> GenerationOutput:
    """Generate continuations of token-id ``prompts`` with ``model`` (a single-stage GPTModel, any tp).

    Raises:
        ValueError: empty prompts, a pipeline-split or sequence-parallel model, or prompt + max_new_tokens
            longer than the model's position table.
    """
    config = config or SamplingConfig()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt and every prompt must hold at least one token")
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        raise ValueError("generate needs the whole model on one pipeline stage (pre_process and post_process)")
    if isinstance(model, PipelineStageModel) and model.ctx.sequence_parallel:
        raise ValueError("generate needs a model built with sequence_parallel=False (decoding one token cannot be "
                         "split along the sequence); the weights are the same, so rebuild it and load them")
    mcfg = model.config
    device = model.grid.device
    lengths = [len(p) for p in prompts]
    batch, prompt_len = len(prompts), max(lengths)
    total = prompt_len + config.max_new_tokens
    if mcfg.position_embedding == "learned" and total > mcfg.max_position_embeddings:
        raise ValueError(f"prompt length {prompt_len} + max_new_tokens {config.max_new_tokens} exceeds "
                         f"model.max_position_embeddings={mcfg.max_position_embeddings}")
    ids = torch.full((batch, prompt_len), config.pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros(batch, total, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, prompt_len - len(p):] = torch.as_tensor(list(p), dtype=torch.long, device=device)
        mask[i, prompt_len - len(p):] = 1
    padded = min(lengths) != prompt_len

    was_training = model.training
    model.eval()
    cache = InferenceCache(batch, total)

    def next_logits(step_input: torch.Tensor, t: int) -> torch.Tensor:
        attn = mask[:, : prompt_len + t] if padded else None
        return model(step_input, attention_mask=attn, gather_logits=True, inference_cache=cache,
                     last_token_only=True)[:, -1]

    try:
        return _decode(next_logits, ids, batch, config, device)
    finally:
        model.train(was_training)


def _decode(next_logits: Callable[[torch.Tensor, int], torch.Tensor], first_input: torch.Tensor, batch: int,
            config: SamplingConfig, device: torch.device) -> GenerationOutput:
    """The decoding loop shared by decoder-only and encoder-decoder generation.

    ``next_logits(step_input, t)`` returns the ``[batch, vocab]`` logits of step ``t`` given the
    tokens fed at that step (``first_input`` at step 0, then the token sampled at ``t - 1``).
    """
    generator = None
    if config.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(config.seed)
    stop = torch.tensor(sorted(set(config.stop_token_ids)), dtype=torch.long, device=device)
    out_tokens = torch.empty(batch, config.max_new_tokens, dtype=torch.long, device=device)
    out_logprobs = torch.empty(batch, config.max_new_tokens, dtype=torch.float32, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    done_at = torch.full((batch,), config.max_new_tokens, dtype=torch.long, device=device)
    step_input = first_input
    for t in range(config.max_new_tokens):
        logits = next_logits(step_input, t).float()
        token = sample_next(logits, config, generator)
        out_tokens[:, t] = token
        out_logprobs[:, t] = logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
        if stop.numel():
            newly = torch.isin(token, stop) & ~finished
            done_at = torch.where(newly, torch.full_like(done_at, t + 1), done_at)
            finished |= newly
            if bool(finished.all()):
                break
        step_input = token[:, None]
    n = t + 1
    tokens, logprobs = out_tokens[:, :n].tolist(), out_logprobs[:, :n].tolist()
    ends = done_at.clamp(max=n).tolist()
    return GenerationOutput(tokens=[row[:e] for row, e in zip(tokens, ends)],
                            logprobs=[row[:e] for row, e in zip(logprobs, ends)])


@torch.no_grad()
def generate_seq2seq(model: torch.nn.Module, sources: Sequence[Sequence[int]], config: SamplingConfig | None = None,
                     *, decoder_start_token_id: int = 0) -> GenerationOutput:
    """Decode targets for token-id ``sources`` with an encoder-decoder ``model`` (a T5Model, any tp).

    The sources are right-padded into one batch (an attention mask hides the padding from the
    encoder and from cross-attention), encoded once, and the decoder runs one token per step from
    ``decoder_start_token_id`` with its key/value cache, using only the model's public
    ``encode``/``decode``/``new_decoder_cache``. Sampling, stop tokens and log-probabilities are as in :func:`generate`;
    the outputs exclude the start token.

    Raises:
        ValueError: empty sources, or a model without ``encode``/``decode``/``new_decoder_cache``.
    """
    config = config or SamplingConfig()
    if not sources or any(len(p) == 0 for p in sources):
        raise ValueError("generate_seq2seq needs at least one source and every source must hold at least one token")
    if not all(hasattr(model, m) for m in ("encode", "decode", "new_decoder_cache")):
        raise ValueError(f"generate_seq2seq needs an encoder-decoder model with encode/decode/new_decoder_cache, got "
                         f"{type(model).__name__}")
    device = next(model.parameters()).device
    batch, src_len = len(sources), max(len(p) for p in sources)
    ids = torch.full((batch, src_len), config.pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros(batch, src_len, dtype=torch.long, device=device)
    for i, p in enumerate(sources):
        ids[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long, device=device)
        mask[i, : len(p)] = 1
    enc_mask = mask if bool((mask == 0).any()) else None

    was_training = model.training
    model.eval()
    try:
        memory = model.encode(ids, enc_mask)  # [s, b, h], computed once
        cache = model.new_decoder_cache()

        def next_logits(step_input: torch.Tensor, t: int) -> torch.Tensor:
            return model.decode(step_input, memory, enc_mask, gather_logits=True, cache=cache)[:, -1]

        start = torch.full((batch, 1), decoder_start_token_id, dtype=torch.long, device=device)
        return _decode(next_logits, start, batch, config, device)
    finally:
        model.train(was_training)
