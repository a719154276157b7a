"""Batched log-likelihoods and generation on a model runner, with the harness's request conventions.

:class:`LMScorer` turns text requests into token requests the way lm-evaluation-harness does
(trailing spaces of a context move to its continuation; the pair is encoded whole and split at the
context's token count; an empty context is the end-of-document token), then scores them in batches
sorted longest first. Each request is ``(input ids, target ids)``: the targets are the tokens
predicted at the last ``len(targets)`` positions of the input plus one, as in the harness's
``_loglikelihood_tokens``. Under data parallelism the requests are dealt round-robin to the dp
ranks and the results gathered back in order, so every rank returns the same list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LMScorer", "TokenScores", "count_windows", "rolling_windows"]


@dataclass
class TokenScores:
    """Scores of one request's target tokens."""

    logprobs: list[float]
    """log p(target_i | input up to it), natural log, fp32 computed."""
    greedy: bool
    """Every target token is the argmax of its distribution."""

    @property
    def total(self) -> float:
        return float(sum(self.logprobs))


def rolling_windows(tokens: Sequence[int], prefix: int, max_length: int, stride: int
                    ) -> Iterator[tuple[list[int], list[int]]]:
    """Strided windows over a document: ``(input ids, target ids)`` scoring every token exactly once.

    The document is predicted from ``prefix`` (the end-of-document token) on. The first window predicts
    the first ``max_length`` tokens; each later one predicts the next ``stride`` tokens (fewer at the
    end) from an input of the ``max_length`` tokens before each of them, so every token after the first
    window sees at least ``max_length - stride`` tokens of context. With ``stride == max_length`` the
    windows are lm-evaluation-harness's ``loglikelihood_rolling`` ones.

    Raises:
        ValueError: ``stride`` outside ``1..max_length``.
    """
    if not 1 <= stride <= max_length:
        raise ValueError(f"stride {stride} must be between 1 and the context length {max_length}")
    seq = [prefix, *tokens]  # seq[i + 1] is tokens[i]; target tokens[i] is predicted from seq[:i + 1]
    n = len(tokens)
    done = min(max_length, n)
    if n:
        yield seq[:done], list(tokens[:done])
    while done < n:
        end = min(done + stride, n)  # predict tokens[done:end]
        yield seq[end - max_length:end], list(tokens[done:end])
        done = end


def count_windows(length: int, max_length: int, stride: int) -> int:
    """How many windows :func:`rolling_windows` makes for a document of ``length`` tokens."""
    return 0 if length == 0 else 1 + max(0, -(-(length - max_length) // stride))


class LMScorer:
    """Log-likelihoods and greedy generation of one model, batched, on any layout.

    Args:
        runner: a :class:`~mg_cli.evaluation.runner.ModelRunner` (the model at its layout).
        tokenizer: an ``mg_data`` tokenizer (``encode``, ``decode``, ``eod``).
        batch_size: requests per forward pass (per data-parallel rank).
        progress: called with the number of requests this rank has just finished.
    """

    def __init__(self, runner: Any, tokenizer: Any, batch_size: int = 8,
                 progress: Callable[[int], None] | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"--batch-size {batch_size} must be >= 1")
        self.runner, self.tokenizer, self.batch_size = runner, tokenizer, batch_size
        self.progress = progress or (lambda n: None)

    @property
    def max_length(self) -> int:
        return self.runner.max_length

    @property
    def prefix_token(self) -> int:
        """The token that stands before a document or an empty context: end of document, else padding, else 0."""
        tok = self.tokenizer
        return next((t for t in (tok.eod, tok.bos, tok.pad) if t is not None), 0)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids, split as lm-evaluation-harness splits them.

        Raises:
            ValueError: the continuation encodes to no tokens.
        """
        enc = self.tokenizer.encode
        if not context:
            cont = enc(continuation)
            if not cont:
                raise ValueError(f"continuation {continuation!r} encodes to no tokens")
            return ([self.prefix_token], cont) if cont[0] != self.prefix_token else (cont[:1], cont[1:])
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = enc(context + continuation), enc(context)
        cont = whole[len(ctx):]
        if not cont:
            raise ValueError(f"continuation {continuation!r} encodes to no tokens after context {context[-40:]!r}")
        return ctx, cont

    def loglikelihood(self, pairs: Sequence[tuple[str, str]]) -> list[TokenScores]:
        """Scores of each ``(context, continuation)`` continuation (left-truncated to the context length)."""
        requests = []
        for context, continuation in pairs:
            ctx, cont = self.encode_pair(context, continuation)
            requests.append(((ctx + cont)[-(self.max_length + 1):][:-1], cont))
        return self.score(requests)

    def score(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[TokenScores]:
        """Scores of ``(input ids, target ids)`` requests (targets: the last positions' next tokens).

        Raises:
            ValueError: an empty input, more targets than inputs, or an input longer than the context.
        """
        for inp, tgt in requests:
            if not inp or not tgt or len(tgt) > len(inp) or len(inp) > self.max_length:
                raise ValueError(f"bad scoring request: {len(inp)} input and {len(tgt)} target tokens "
                                 f"(context length {self.max_length})")
        return self.runner.map_examples(list(requests), self._score_local)

    def _score_local(self, requests: list[tuple[Sequence[int], Sequence[int]]]) -> list[TokenScores]:
        order = sorted(range(len(requests)), key=lambda i: (-len(requests[i][0]), i))
        out: list[TokenScores | None] = [None] * len(requests)
        device = self.runner.device
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            width = len(requests[batch[0]][0])
            ids = torch.zeros(len(batch), width, dtype=torch.long)  # right padding: causal attention ignores it
            scored = torch.zeros(len(batch), width, dtype=torch.bool)  # the positions whose next token is a target
            targets: list[int] = []
            for row, i in enumerate(batch):
                inp, tgt = requests[i]
                ids[row, : len(inp)] = torch.as_tensor(inp, dtype=torch.long)
                scored[row, len(inp) - len(tgt): len(inp)] = True
                targets.extend(tgt)  # row-major, as the logits come back
            target = torch.as_tensor(targets, dtype=torch.long, device=device)
            logprobs = self.runner.logits(ids.to(device), scored.to(device)).float().log_softmax(-1)  # [n, V]
            picked = logprobs.gather(-1, target[:, None]).squeeze(-1).tolist()
            hits = (logprobs.argmax(-1) == target).tolist()
            at = 0
            for i in batch:
                t = len(requests[i][1])
                out[i] = TokenScores(picked[at:at + t], all(hits[at:at + t]))
                at += t
            self.progress(len(batch))
        return out  # type: ignore[return-value]

    def rolling(self, documents: Sequence[Sequence[int]], stride: int | None = None,
                prefixes: Sequence[int] | None = None) -> list[TokenScores]:
        """Scores of every token of each document, in strided windows (see :func:`rolling_windows`).

        Each document is predicted from its entry of ``prefixes`` (default: :attr:`prefix_token`).
        """
        stride = stride or self.max_length
        windows, owner = [], []
        for d, toks in enumerate(documents):
            prefix = self.prefix_token if prefixes is None else prefixes[d]
            for w in rolling_windows(toks, prefix, self.max_length, stride):
                windows.append(w)
                owner.append(d)
        scores = self.score(windows)
        merged = [TokenScores([], True) for _ in documents]
        for d, s in zip(owner, scores):
            merged[d].logprobs.extend(s.logprobs)
            merged[d].greedy &= s.greedy
        return merged

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 seed: int = 0, stop_token_ids: Sequence[int] = ()) -> list[list[int]]:
        """Continuations (token ids) of each prompt, with the model's KV-cache generation, in batches.

        Prompts are left-truncated so that prompt + ``max_new_tokens`` fit the context (T5: the prompt alone,
        its encoder input). Sampling with
        ``temperature > 0`` is seeded per prompt (``seed`` + its index), so results do not depend on
        the batch or the layout.
        """
        # A decoder-only model's prompt and continuation share the context; an encoder's input has it to itself.
        keep = self.max_length if self.runner.family.kind == "encoder-decoder" else self.max_length - max_new_tokens
        if keep < 1:
            raise ValueError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the context "
                             f"length {self.max_length}")
        items = [(i, list(p)[-keep:]) for i, p in enumerate(prompts)]

        def local(chunk: list[tuple[int, list[int]]]) -> list[list[int]]:
            out: list[list[int]] = []
            step = self.batch_size if temperature == 0 else 1
            for start in range(0, len(chunk), step):
                batch = chunk[start:start + step]
                out.extend(self.runner.generate([p for _, p in batch], max_new_tokens=max_new_tokens,
                                                temperature=temperature, seed=seed + batch[0][0],
                                                stop_token_ids=stop_token_ids))
                self.progress(len(batch))
            return out

        return self.runner.map_examples(items, local)
