"""Choosing the K layers."""

import pytest

from fora_plugin.selection import check_layer_indices, resolve_layer_budget, select_layers


def test_top_k_takes_the_highest_scores_and_breaks_ties_by_lower_index():
    scores = [0.1, 0.9, 0.5, 0.9, 0.2, 0.5]
    assert select_layers(scores, 2) == [1, 3]
    assert select_layers(scores, 3) == [1, 2, 3]  # 2 and 5 tie at 0.5: the lower index wins
    assert select_layers(scores, 6) == [0, 1, 2, 3, 4, 5]


def test_control_strategies():
    assert select_layers(None, 3, strategy="first", num_layers=8) == [0, 1, 2]
    assert select_layers(None, 3, strategy="last", num_layers=8) == [5, 6, 7]
    picked = select_layers(None, 4, strategy="random", num_layers=18, seed=3)
    assert picked == select_layers(None, 4, strategy="random", num_layers=18, seed=3)  # seeded
    assert picked != select_layers(None, 4, strategy="random", num_layers=18, seed=4)
    assert len(set(picked)) == 4 and picked == sorted(picked) and all(0 <= i < 18 for i in picked)


@pytest.mark.parametrize(
    ("budget", "num_layers", "k"), [(0.5, 18, 9), (0.5, 32, 16), (0.3, 18, 5), (1.0, 7, 7), (3, 18, 3), (1, 4, 1)]
)
def test_layer_budget_fraction_or_count(budget, num_layers, k):
    assert resolve_layer_budget(budget, num_layers) == k


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        (1.5, r"layer_budget=1.5 is a fraction outside \(0, 1\]"),
        (0.0, r"layer_budget=0.0 is a fraction outside"),
        (0.01, r"layer_budget=0.01 of 18 layers gives K=0"),
        (19, r"layer_budget=19 layers is outside 1..18"),
        (0, r"layer_budget=0 layers is outside 1..18"),
    ],
)
def test_bad_budgets_name_the_value(budget, message):
    with pytest.raises(ValueError, match=message):
        resolve_layer_budget(budget, 18)


def test_bad_selection_inputs():
    with pytest.raises(ValueError, match=r"layer_strategy='best'.*'fisher', 'random', 'first', 'last'"):
        select_layers([1.0, 2.0], 1, strategy="best")
    with pytest.raises(ValueError, match=r"K=3 layers is invalid for a model with 2 layers"):
        select_layers([1.0, 2.0], 3)
    with pytest.raises(ValueError, match=r"K=0 layers"):
        select_layers([1.0, 2.0], 0)
    with pytest.raises(ValueError, match=r"needs Fisher scores"):
        select_layers(None, 1)
    with pytest.raises(ValueError, match=r"indices \[4, -1\] outside 0..3"):
        check_layer_indices([0, 4, -1], 4)
    with pytest.raises(ValueError, match=r"repeats"):
        check_layer_indices([1, 1], 4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_scores_are_refused_naming_the_layers(bad):
    scores = [0.3, bad, 0.2, bad, 0.1]
    with pytest.raises(ValueError, match=rf"Fisher scores of layers \[1, 3\] are not finite \(1: {bad}, 3: {bad}\)"):
        select_layers(scores, 2)
    assert select_layers(scores, 2, strategy="first") == [0, 1]  # the controls do not read the scores
