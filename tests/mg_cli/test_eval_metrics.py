"""Evaluation metrics against independent computations: closed forms, scikit-learn, sacrebleu, the harness."""

from __future__ import annotations

import math
import statistics
from math import comb

import pytest

from mg_cli.evaluation import metrics as M
from mg_cli.evaluation.lm import count_windows, rolling_windows


@pytest.mark.parametrize("n,c,k", [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (10, 3, 5), (10, 9, 2), (20, 0, 10),
                                   (200, 17, 100)])
def test_pass_at_k_equals_closed_form(n, c, k):
    assert M.pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError, match="num-samples"):
        M.pass_at_k(3, 1, 5)


def test_mean_stderr_is_sample_stddev_over_sqrt_n():
    values = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    mu, se = M.mean_stderr(values)
    assert mu == pytest.approx(statistics.fmean(values))
    assert se == pytest.approx(statistics.stdev(values) / math.sqrt(len(values)))
    assert M.mean_stderr([3.0]) == (3.0, None)


def test_classification_report_matches_scikit_learn():
    from sklearn import metrics as sklearn
    golds = [0, 1, 2, 2, 1, 0, 3, 1, 2, 0]
    preds = [0, 2, 2, 1, 1, 0, 0, 1, 2, 4]  # class 4 only predicted; class 3 never predicted right
    rep = M.classification_report(golds, preds, num_labels=5)
    assert rep["macro_f1"] == pytest.approx(sklearn.f1_score(golds, preds, average="macro"))
    assert rep["accuracy"]["value"] == pytest.approx(sklearn.accuracy_score(golds, preds))
    assert rep["confusion_matrix"] == sklearn.confusion_matrix(golds, preds, labels=range(5)).tolist()


def test_squad_exact_match_and_f1():
    assert M.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert M.squad_exact_match("the Eiffel Tower.", ["Eiffel tower"]) == 1.0
    # pred {big, red, dog} vs gold {red, dog, barks}: 2 common, p = r = 2/3
    assert M.squad_f1("a big red dog", ["Red dog barks", "cat"]) == pytest.approx(2 / 3)
    assert M.squad_f1("nothing here", ["red dog"]) == 0.0
    assert M.squad_f1("", [""]) == 1.0


def test_bleu_and_chrf_are_sacrebleus():
    import sacrebleu
    hyps = ["the cat sat on the mat", "a quick brown fox"]
    refs = ["the cat is on the mat", "the quick brown fox jumps"]
    assert M.corpus_bleu(hyps, refs) == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert M.corpus_chrf(hyps, refs) == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score)


def test_acc_norm_divides_by_characters_and_ties_go_first():
    # -6 over 3 characters beats -4 over 1 once normalised, not before.
    assert M.choice_predictions([-6.0, -4.0], ["abc", "d"]) == (1, 0)
    assert M.choice_predictions([-2.0, -2.0], ["ab", "ab"]) == (0, 0)


@pytest.mark.parametrize("n", [1, 5, 8, 9, 30])
@pytest.mark.parametrize("max_length,stride", [(8, 8), (8, 3), (8, 1), (4, 4)])
def test_rolling_windows_score_every_token_once_with_its_context(n, max_length, stride):
    tokens = list(range(100, 100 + n))
    windows = list(rolling_windows(tokens, 7, max_length, stride))
    assert len(windows) == count_windows(n, max_length, stride)
    seq = [7, *tokens]
    assert [t for _, tgt in windows for t in tgt] == tokens
    done = 0
    for inp, tgt in windows:
        assert len(inp) <= max_length and len(tgt) <= len(inp)
        # the input ends right before the last target and is the longest context that fits
        end = done + len(tgt)
        assert inp == seq[max(0, end - max_length):end]
        done = end


def test_rolling_windows_equal_the_harness_at_full_stride():
    from lm_eval import utils
    for n in (1, 7, 8, 9, 25):
        tokens = list(range(10, 10 + n))
        theirs = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(tokens, 3, 8, 1)]
        ours = []
        for inp, tgt in rolling_windows(tokens, 3, 8, 8):
            ours.append((inp[: len(inp) - len(tgt) + 1], tgt))  # the harness's (context, continuation)
        assert ours == [(list(a), list(b)) for a, b in theirs]
