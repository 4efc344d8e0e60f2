"""fora ablate's per-run configs: each run drops the layer-choosing keys it decides itself, so every run of one
config is accepted (the grid end to end is in test_cli.py, its refusals in test_cli_errors.py)."""

import pytest
import yaml

from fora_plugin.ablate import RUNS, run_config, run_overrides
from fora_plugin.recipe import parse_config


SHARED = {
    "model_name_or_path": "org/model",
    "dataset_name": "rows.json",
    "lora_r": 4,
    "lora_alpha": 8,
    "fora_layer_budget": 0.5,
    "fora_scores_path": "fora_scores.json",
    "output_dir": "out",
    "report_to": "none",
    "use_cpu": True,
}


def test_runs_that_choose_their_own_layers_drop_the_keys_that_would_choose_them():
    for name in ("fora", "fg-lora"):
        assert run_config(SHARED, name) == SHARED
    for name in ("lora", "stiefel-lora", "lora-half-rank", "random-k", "dora", "rslora"):
        assert run_config(SHARED, name) == {k: v for k, v in SHARED.items() if k != "fora_scores_path"}


@pytest.mark.parametrize("name", RUNS)
def test_every_run_of_a_config_with_saved_scores_is_accepted(tmp_path, name):
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(run_config(SHARED, name)))
    fora = parse_config(str(config), run_overrides(name, 4, 8))[3]
    assert (fora.scores_path is not None) == (name in ("fora", "fg-lora"))
