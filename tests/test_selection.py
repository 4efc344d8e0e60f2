"""Choosing the K layers, and the record of the choice (fora_scores.json): saved and loaded back whole, refused
when malformed or of other layers than the adapter beside it."""

import json

import pytest

from fora_plugin.fisher import FisherScores
from fora_plugin.selection import (
    SCORES_FILE,
    FoRASelection,
    check_layer_indices,
    load_scores,
    resolve_layer_budget,
    select_layers,
)


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


def test_selection_must_be_the_adapters_layers(tmp_path):
    assert FoRASelection.load(tmp_path, missing_ok=True) is None  # no selection file: nothing to compare
    (tmp_path / SCORES_FILE).write_text(json.dumps({"chosen_layers": [1, 0], "num_layers": 4}))
    selection = FoRASelection.load(tmp_path)
    selection.check_adapter_layers([0, 1], tmp_path)
    with pytest.raises(ValueError, match=r"says layers \[0, 1\] were chosen, but the adapter .* is on layers \[2\]"):
        selection.check_adapter_layers([2], tmp_path)


def test_the_record_round_trips_through_its_file(tmp_path):
    scores = FisherScores([0.5, 2.0, 1.0], 7, "layer", 1.5, 123, "model.layers")
    selection = FoRASelection([2, 1], 3, "model.layers", scores=scores, source="fisher", mode="fg-lora")
    selection.target_modules = ["model.layers.1.self_attn.q_proj"]
    selection.trainable_parameters = {1: 10, 2: 12}
    selection.lora_all_layers_parameters = 33
    file = selection.save(tmp_path / "out")
    assert file == tmp_path / "out" / SCORES_FILE
    saved = json.loads(file.read_text())
    assert saved["chosen_layers"] == [1, 2] and saved["k"] == 2 and saved["scores"] == [0.5, 2.0, 1.0]
    assert saved["trainable_parameters_per_layer"] == {"1": 10, "2": 12}
    loaded = FoRASelection.load(tmp_path / "out")
    assert loaded == selection and loaded.to_dict() == saved
    assert FoRASelection.load(file) == selection  # the file itself, or its folder


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"chosen_layers": [0], "num_layers": 2', r"is not valid JSON: .* at line 1"),
        ("[0, 1]", r"is not a FoRA selection \(TypeError: a list, not a mapping\)"),
        ('{"num_layers": 2}', r"is not a FoRA selection \(KeyError: 'chosen_layers'\)"),
        ('{"chosen_layers": "0", "num_layers": 2}', r"is not a FoRA selection \(TypeError: chosen_layers='0'"),
        ('{"chosen_layers": [0], "num_layers": 2, "scores": "high"}', r"its scores 'high' are not one number"),
    ],
)
def test_a_malformed_record_is_refused_naming_the_file(tmp_path, text, message):
    (tmp_path / SCORES_FILE).write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        FoRASelection.load(tmp_path)
    assert SCORES_FILE in str(info.value)
    with pytest.raises(ValueError, match=r"No FoRA selection at .*nope"):
        FoRASelection.load(tmp_path / "nope")


def test_saved_scores_are_read_for_this_models_layer_count_only(tmp_path):
    file = tmp_path / "s.json"
    file.write_text(json.dumps({"scores": [0.1, 0.9, 0.5]}))  # the scores alone are enough
    scores = load_scores(file, 3, "scores_path")
    assert scores.scores == [0.1, 0.9, 0.5] and select_layers(scores.scores, 1) == [1]
    with pytest.raises(ValueError, match=r"scores_path='.*s\.json' holds scores for 3 layers, but this model has 4"):
        load_scores(file, 4, "scores_path")
    file.write_text(json.dumps({"chosen_layers": [0], "num_layers": 3, "scores": None}))
    with pytest.raises(ValueError, match=r"holds no scores, but this model has 3 decoder layers"):
        load_scores(file, 3, "scores_path")
