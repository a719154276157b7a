"""``EvalOptions``: how ``mg eval`` runs its tasks, and the precision key ``mg eval`` and ``mg generate`` share with
``mg train`` (no torch import, so ``--help`` stays instant)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PRECISION_KEY", "EvalOptions", "inference_precision"]

PRECISION_KEY = "train.precision"
"""The key that sets the model's precision, as in ``mg train``'s configuration."""


def inference_precision(sets: Sequence[str], dtype: str | None) -> tuple[str, list[str]]:
    """The precision name ``--set train.precision=NAME`` (or its alias ``--dtype NAME``) asks for, ``fp32`` when
    neither is given, and the other ``--set`` strings, in order, for the command to read.

    The value is parsed and checked as ``mg train`` checks the key (a YAML value, one of ``fp32``, ``bf16``,
    ``fp16``), so a bad one reads the same in every command; the last ``--set`` of the key wins.

    Raises:
        mg_cli.config.ConfigError: a bad value (``--set: train.precision='fp8' is not one of ...``), or ``--dtype``
            and ``--set train.precision`` given with different values.
    """
    from mg_cli.config import ConfigError, parse_override
    from mg_cli.schema import check_type
    from mg_cli.sections import SCHEMA

    section, leaf = PRECISION_KEY.split(".")
    key_type = SCHEMA.keys(section)[leaf].type
    chosen, others = None, []
    for text in sets:
        if text.partition("=")[0].strip() != PRECISION_KEY or "=" not in text:
            others.append(text)
            continue
        try:
            chosen = check_type(parse_override(text)[2], key_type, PRECISION_KEY)
        except ConfigError as e:
            raise ConfigError(f"--set: {e}") from None
    if dtype is not None and chosen is not None and dtype != chosen:
        raise ConfigError(f"--dtype {dtype} and --set {PRECISION_KEY}={chosen} disagree; --dtype is an alias of "
                          f"--set {PRECISION_KEY}, give one of them")
    return str(chosen or dtype or "fp32"), others


@dataclass(kw_only=True)
class EvalOptions:
    """How tasks run (the ``mg eval`` options)."""

    limit: int | None = None
    """Score only the first K examples (documents, for perplexity) of each task."""
    stride: int | None = None
    """Perplexity: tokens predicted per window after the first (default: the context length)."""
    target_delimiter: str = " "
    """Multiple choice: text between the context and each choice (lm-evaluation-harness's default)."""
    max_new_tokens: int = 64
    """Generation tasks: most tokens generated per example."""
    until: tuple[str, ...] | None = None
    """Generation tasks: cut a generated text at the first of these (default: a newline for GPT, none for T5;
    humaneval: the next top-level statement)."""
    chat_template: str = "chatml"
    """SFT: the chat template (``mg_data.load_chat_template`` names: chatml, auto, or a Jinja file)."""
    num_samples: int = 1
    """HumanEval: programs generated per problem (n of pass@k)."""
    pass_k: tuple[int, ...] = (1,)
    """HumanEval: the k of pass@k (each at most num_samples)."""
    temperature: float = 0.0
    """HumanEval: sampling temperature (0 = greedy; num_samples > 1 needs > 0)."""
    seed: int = 0
    """Sampling seed (sample i of a task uses seed + i)."""
    timeout_s: float = 10.0
    """HumanEval: time limit of each program, seconds."""
    allow_code_execution: bool = False
    """HumanEval: run the generated programs (they are untrusted code)."""

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit {self.limit} must be >= 1")
        if self.num_samples < 1:
            raise ValueError(f"--num-samples {self.num_samples} must be >= 1")
        if any(not 1 <= k <= self.num_samples for k in self.pass_k):
            raise ValueError(f"--pass-k {','.join(map(str, self.pass_k))}: each k must be between 1 and "
                             f"--num-samples {self.num_samples}")
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(f"--num-samples {self.num_samples} with --temperature 0 draws the same program "
                             f"every time; set --temperature (e.g. 0.8) or use --num-samples 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens} must be >= 1")
