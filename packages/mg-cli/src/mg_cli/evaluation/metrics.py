"""Metric formulas, in plain Python (no torch): each is the standard definition, stated in its docstring.

Log-likelihood metrics follow lm-evaluation-harness: ``acc`` picks the choice with the largest total
log-likelihood, ``acc_norm`` the largest log-likelihood divided by the choice's length in characters
(the delimiter before it excluded); ties go to the first choice. Standard errors of means are the
sample standard deviation over the square root of the number of examples.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MeanWithError",
    "argmax",
    "bits_per_byte",
    "choice_predictions",
    "classification_report",
    "corpus_bleu",
    "corpus_chrf",
    "mean_stderr",
    "normalize_answer",
    "pass_at_k",
    "squad_exact_match",
    "squad_f1",
]


def mean_stderr(values: Sequence[float]) -> tuple[float, float | None]:
    """``(mean, standard error of the mean)``: sample standard deviation (n - 1) / sqrt(n); None for n < 2.

    Raises:
        ValueError: no values.
    """
    n = len(values)
    if n == 0:
        raise ValueError("mean of no values")
    mu = math.fsum(values) / n
    if n < 2:
        return mu, None
    var = math.fsum((v - mu) ** 2 for v in values) / (n - 1)
    return mu, math.sqrt(var) / math.sqrt(n)


class MeanWithError(dict):
    """A JSON-ready ``{"value": mean, "stderr": standard error}`` of per-example values."""

    def __init__(self, values: Sequence[float]) -> None:
        mu, se = mean_stderr(values)
        super().__init__(value=mu, stderr=se)


def argmax(values: Sequence[float]) -> int:
    """Index of the largest value; the first one on ties (as ``numpy.argmax``)."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def choice_predictions(logliks: Sequence[float], choices: Sequence[str]) -> tuple[int, int]:
    """``(pred, pred_norm)``: the choice of largest total log-likelihood, and of largest log-likelihood per
    character of the choice text (``len(choice)``, the delimiter before it not counted; task files reject
    empty choices)."""
    return argmax(logliks), argmax([ll / len(c) for ll, c in zip(logliks, choices)])


def bits_per_byte(total_nll_nats: float, total_bytes: int) -> float:
    """Total negative log-likelihood (nats) converted to bits, per UTF-8 byte of the scored text."""
    return total_nll_nats / math.log(2) / total_bytes


def classification_report(golds: Sequence[int], preds: Sequence[int], num_labels: int | None = None
                          ) -> dict[str, Any]:
    """Accuracy, macro-F1 and the confusion matrix of integer class predictions.

    Macro-F1 is the unweighted mean over classes of ``2 tp / (2 tp + fp + fn)``, over the classes that
    occur in ``golds`` or ``preds`` (a class with no gold and no prediction is left out; a class
    with ``tp = 0`` counts 0), as scikit-learn's ``f1_score(average="macro")``. ``confusion[i][j]``
    counts examples of gold class i predicted as j, for classes ``0..num_labels-1`` (default: the
    largest class seen + 1).
    """
    n = len(golds)
    if n == 0 or n != len(preds):
        raise ValueError(f"classification_report needs as many predictions as golds (got {len(preds)} and {n})")
    k = num_labels if num_labels is not None else max(max(golds), max(preds)) + 1
    confusion = [[0] * k for _ in range(k)]
    for g, p in zip(golds, preds):
        confusion[g][p] += 1
    f1s = []
    for c in sorted(set(golds) | set(preds)):
        tp = confusion[c][c]
        fp = sum(confusion[r][c] for r in range(k)) - tp
        fn = sum(confusion[c]) - tp
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    accuracy = MeanWithError([float(g == p) for g, p in zip(golds, preds)])
    return {"accuracy": accuracy, "macro_f1": math.fsum(f1s) / len(f1s), "confusion_matrix": confusion}


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lower case, punctuation removed, articles (a, an, the) removed,
    whitespace collapsed to single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def squad_exact_match(prediction: str, references: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals any normalised reference, else 0.0."""
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(r) for r in references))


def _token_f1(prediction: str, reference: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:  # SQuAD 2.0: an empty answer scores 1 only against an empty answer
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def squad_f1(prediction: str, references: Sequence[str]) -> float:
    """SQuAD token F1: the best over references of the F1 of the bags of normalised words."""
    return max(_token_f1(prediction, r) for r in references)


def _sacrebleu() -> Any:
    try:
        import sacrebleu
    except ImportError:
        raise ImportError("BLEU and chrF need sacrebleu: pip install 'mg-cli[eval]'") from None
    return sacrebleu


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """sacrebleu's corpus BLEU (default 13a tokenisation), 0-100.

    Raises:
        ImportError: sacrebleu is not installed (the message says how to install it).
    """
    return float(_sacrebleu().corpus_bleu(list(hypotheses), [list(references)]).score)


def corpus_chrf(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """sacrebleu's corpus chrF (character 6-grams, beta 2), 0-100.

    Raises:
        ImportError: sacrebleu is not installed.
    """
    return float(_sacrebleu().corpus_chrf(list(hypotheses), [list(references)]).score)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator: ``1 - C(n - c, k) / C(n, k)`` for ``c`` correct samples of ``n``.

    Computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``, which avoids large binomials; 1.0 when
    fewer than ``k`` samples fail.

    Raises:
        ValueError: ``k`` outside ``1..n`` or ``c`` outside ``0..n``.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples per problem; raise --num-samples")
    if not 0 <= c <= n:
        raise ValueError(f"{c} correct of {n} samples")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod
