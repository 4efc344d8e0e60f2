"""The up-front checks of fora_plugin.validation: each accepts the edge of its range and refuses just past it."""

from __future__ import annotations

import json
import math
import re

import pytest
from conftest import EXPERT_PARAMETERS, TARGETS, char_tokenizer, tiny_llama, tiny_moe

from fora_plugin.targets import check_target_modules, check_target_parameters, target_names
from fora_plugin.validation import (
    NUMBER_RULES,
    check_adapter_folder,
    check_block,
    check_number,
    suggestion,
)


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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    tiny_llama(2).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def test_target_modules_are_checked_against_the_model_on_the_meta_device(model_dir):
    check_target_modules(str(model_dir), TARGETS, key="lora_target_modules")
    check_target_modules(str(model_dir), ["self_attn.q_proj", "lm_head"], key="lora_target_modules")
    check_target_modules(str(model_dir), "all-linear", key="lora_target_modules")  # PEFT's own rule
    check_target_modules("org/hub-model", ["anything"], key="lora_target_modules")  # not checkable offline
    with pytest.raises(ValueError, match=r"no module named \['qproj'\].*For 'qproj', did you mean q_proj\?"):
        check_target_modules(str(model_dir), ["qproj"], key="lora_target_modules")
    with pytest.raises(ValueError, match=r"`--lora_target_modules q_proj v_proj` on the command line"):
        check_target_modules(str(model_dir), ["q_proj,v_proj"], key="lora_target_modules")
    with pytest.raises(ValueError, match=r"`lora_target_modules: \[q_proj, v_proj, k_proj\]`"):
        check_target_modules(str(model_dir), ["q_proj v_proj", "k_proj"], key="lora_target_modules")


def _adapter(folder, **lora):
    from peft import LoraConfig, get_peft_model

    get_peft_model(tiny_llama(2), LoraConfig(target_modules=["q_proj", "v_proj"], **lora)).save_pretrained(folder)
    return folder


def test_adapter_config_must_match_the_weights_ranks(tmp_path):
    plain = _adapter(tmp_path / "plain", r=4)
    assert check_adapter_folder(plain, "adapter")["r"] == 4
    patterned = _adapter(tmp_path / "patterned", r=4, rank_pattern={"v_proj": 2})
    check_adapter_folder(patterned, "adapter")  # rank_pattern's ranks are the config's too
    config = json.loads((plain / "adapter_config.json").read_text())
    (plain / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    with pytest.raises(ValueError, match=r"adapter adapter_config\.json r=8 is invalid: the weights of 4 modules"):
        check_adapter_folder(plain, "adapter")
    (plain / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 0}))
    with pytest.raises(ValueError, match=r"lora_alpha=0 is invalid"):
        check_adapter_folder(plain, "adapter")


def test_target_parameters_are_checked_against_the_models_parameters(tmp_path):
    tiny_moe(2).save_pretrained(tmp_path)
    check_target_parameters(str(tmp_path), EXPERT_PARAMETERS, key="lora_target_parameters")
    with pytest.raises(ValueError, match=r"no parameter named \['mlp.experts.gate_proj'\] \(its fused expert par"):
        check_target_parameters(str(tmp_path), ["mlp.experts.gate_proj"], key="lora_target_parameters")


def test_one_target_name_given_alone_is_a_list_of_one():
    """TRL's ModelConfig turns `[q_proj]` into "q_proj", which PEFT reads as a regex of a whole module name."""
    assert target_names("q_proj") == ["q_proj"] and target_names("model.layers.0.mlp") == ["model.layers.0.mlp"]
    assert target_names("all-linear") == "all-linear" and target_names(r".*\.q_proj") == r".*\.q_proj"
    assert target_names(["q_proj"]) == ["q_proj"] and target_names(None) is None


def test_fused_moe_targets_are_accepted_whole_and_refused_in_part():
    config = tiny_moe(2, num_experts=2).config
    for whole in (["q_proj", "gate_proj", "up_proj", "down_proj"], ["down_proj"], ["mlp.gate"]):
        check_target_modules(config, whole, key="lora_target_modules")  # what PEFT converts to target_parameters
    with pytest.raises(ValueError, match=r"gate_proj and up_proj are one parameter, gate_up_proj, so gate_proj"):
        check_target_modules(config, ["gate_proj"], key="lora_target_modules")


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
