"""fora_plugin.validation: each number rule accepts the edge of its range and refuses just past it; a config block
refuses unknown keys with the closest known one."""

from __future__ import annotations

import math
import re

import pytest

from fora_plugin.validation import NUMBER_RULES, check_block, check_number, suggestion


# key -> (values accepted at the edge of the range, values refused just past it or of the wrong kind)
EDGES = {
    "lora_r": ([1, 64], [0, -1, 1.5, True, "8"]),
    "lora_alpha": ([1e-3, 16], [0, -8, math.nan, math.inf]),
    "lora_dropout": ([0.0, 0.99], [1.0, -0.1, math.nan]),
    "per_device_train_batch_size": ([1], [0, -2]),
    "per_device_eval_batch_size": ([1], [0]),
    "gradient_accumulation_steps": ([1], [0]),
    "max_steps": ([-1, 1], [0, -2]),
    "num_train_epochs": ([0.5, 3], [0, -1, math.inf]),
    "max_length": ([1, None], [0, -5]),
    "warmup_steps": ([0, 0.1, 10], [-1, math.nan]),
    "warmup_ratio": ([0.0, 1.0, None], [1.5, -0.1]),
    "weight_decay": ([0.0, 0.1], [-0.01, math.nan]),
    "max_grad_norm": ([0.0, 1.0], [-1.0, math.nan, math.inf]),
    "adam_beta1": ([0.0, 0.9], [1.0, -0.1]),
    "adam_beta2": ([0.999], [1.0, 1.5]),
    "adam_epsilon": ([0.0, 1e-8], [-1e-8, math.nan]),
    "label_smoothing_factor": ([0.0, 0.1], [1.0, -0.1]),
    "logging_steps": ([1, 0.1], [0, -1]),
    "save_steps": ([1], [0]),
    "eval_steps": ([None, 5], [0]),
    "save_total_limit": ([None, 1], [0, -1]),
    "dataloader_num_workers": ([0, 4], [-1]),
    "dataset_num_proc": ([None, 1], [0]),
    "seed": ([0, 2**32 - 1], [-1, 2**32]),
    "micro_batch_size": ([1], [0]),
    "sequence_len": ([1, 2048], [0]),
    "num_epochs": ([0.5, 1], [0, math.nan]),
    "--max-examples": ([None, 1], [0, -5]),
    "--batch-size": ([1], [0]),
    "--max-new-tokens": ([1], [0]),
    "--ppl-max-length": ([2], [1, 0]),
    "--ppl-stride": ([1], [0]),
    "--ppl-max-tokens": ([None, 2], [1, 0]),
    "--kl-max-tokens": ([1], [0]),
    "max_examples": ([None, 1], [0, -5]),
    "batch_size": ([1], [0]),
    "max_new_tokens": ([1], [0]),
    "kl_max_tokens": ([1], [0]),
    "eval_loss_examples": ([0, 40], [-1]),
}


def test_every_rule_has_its_edges_tested():
    assert set(EDGES) == set(NUMBER_RULES)


@pytest.mark.parametrize("key", sorted(EDGES))
def test_each_number_rule_accepts_its_range_and_refuses_past_it_by_name(key):
    accepted, refused = EDGES[key]
    for value in accepted:
        check_number(key, value)
    for value in refused:
        with pytest.raises(ValueError, match="^" + re.escape(f"{key}={value!r} is invalid: ")):
            check_number(key, value)


def test_a_block_refuses_unknown_keys_with_the_closest_and_strings_for_lists():
    keys = ["runs", "output_dir", "eval"]
    assert check_block({"runs": ["a"], "eval": {}}, keys, "ablation", lists=["runs"]) == {"runs": ["a"], "eval": {}}
    with pytest.raises(ValueError, match=r"^ablation has unknown keys \['evaluation'\]: .*did you mean eval\?$"):
        check_block({"evaluation": {}}, keys, "ablation")
    with pytest.raises(
        ValueError, match=r"ablation\.runs='lora, fora' is invalid: give a list\. .*`runs: \[lora, fora\]`"
    ):
        check_block({"runs": "lora, fora"}, keys, "ablation", lists=["runs"])
    with pytest.raises(ValueError, match=r"ablation=\['runs'\] is invalid: give a mapping of its keys"):
        check_block(["runs"], keys, "ablation")


def test_the_closest_key_is_a_near_spelling_or_the_one_key_a_name_begins_with():
    assert suggestion("lerning_rate", ["learning_rate", "lr_scheduler_type"]) == " Did you mean learning_rate?"
    assert suggestion("evaluation", ["eval", "runs"]) == " Did you mean eval?"
    assert suggestion("judge", ["judge_model", "judge_timeout"]) == ""  # two keys begin with it: no guess
    assert suggestion("xyz", ["eval", "runs"]) == ""
