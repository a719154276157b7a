"""``EvalOptions``: how ``mg eval`` runs its tasks (no torch import, so ``mg eval --help`` stays instant)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EvalOptions"]


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
