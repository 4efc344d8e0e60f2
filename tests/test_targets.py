"""fora_plugin.targets: PEFT's target-name matching, decoder layers and their indices, and the target names a user
gives checked against the model (on the meta device) before it loads."""

import pytest
import torch
from conftest import EXPERT_PARAMETERS, TARGETS, tiny_moe
from peft import LoraConfig, get_peft_model
from torch import nn

from fora_plugin.errors import FoRAInputError
from fora_plugin.targets import (
    base_name,
    check_target_modules,
    check_target_parameters,
    find_decoder_layers,
    is_linear_like,
    layer_index,
    matches_target,
    module_names,
    target_names,
)


@pytest.mark.parametrize(
    ("name", "targets", "expected"),
    [
        ("model.layers.0.self_attn.q_proj", ["q_proj"], True),
        ("model.layers.0.self_attn.q_proj", ["self_attn.q_proj"], True),
        ("q_proj", ["q_proj"], True),
        ("model.layers.0.self_attn.xq_proj", ["q_proj"], False),  # a suffix after a dot, not any suffix
        ("model.layers.0.mlp.down_proj", ["q_proj", "v_proj"], False),
    ],
)
def test_a_target_matches_its_name_or_a_suffix_after_a_dot_as_peft_matches_it(name, targets, expected):
    assert matches_target(name, targets) is expected


def test_peft_matching_agrees_with_ours_on_a_wrapped_model(llama):
    # PEFT's own matching decides which modules get LoRA: ours must pick the same ones.
    targets = ["q_proj", "mlp.down_proj"]
    wrapped = get_peft_model(llama, LoraConfig(r=2, target_modules=targets))
    adapted = {
        base_name(n).removeprefix("base_model.model.") for n, _ in wrapped.named_modules() if n.endswith("lora_A")
    }
    adapted = {n.rsplit(".lora_A", 1)[0] for n in adapted}
    _, linear, _ = module_names(llama.get_base_model() if hasattr(llama, "get_base_model") else llama)
    ours = {n for n in linear if matches_target(n, targets)}
    assert ours == adapted


def test_base_name_drops_peft_base_layer_hops():
    assert base_name("model.layers.1.mlp.up_proj.base_layer.weight") == "model.layers.1.mlp.up_proj.weight"
    assert base_name("a.base_layer.base_layer.b") == "a.b"


def test_layer_index_with_and_without_the_models_prefix():
    assert layer_index("base_model.model.model.layers.12.mlp.up_proj", "model.layers") == 12
    assert layer_index("model.embed_tokens", "model.layers") is None
    assert layer_index("model.layers.norm", "model.layers") is None
    # Without the model (an adapter file): the number after `layers` or `h`.
    assert layer_index("base_model.model.transformer.h.3.attn.c_attn.lora_A.weight") == 3
    assert layer_index("base_model.model.lm_head.lora_B.weight") is None


def test_decoder_layers_and_linears_of_a_model(llama):
    prefix, layers = find_decoder_layers(llama)
    assert prefix == "model.layers" and len(layers) == llama.config.num_hidden_layers
    names, linear, in_layers = module_names(llama)
    assert set(linear) == {n for n, m in llama.named_modules() if isinstance(m, nn.Linear)}
    assert set(in_layers) == {n for n in linear if n.startswith("model.layers.")}
    assert "lm_head" in linear and "lm_head" not in in_layers and len(names) > len(linear)
    assert not is_linear_like(nn.LayerNorm(4)) and is_linear_like(nn.Linear(2, 3))


def test_a_model_without_decoder_layers_is_refused_by_name():
    with pytest.raises(FoRAInputError, match=r"Cannot find the decoder layers of Sequential"):
        find_decoder_layers(nn.Sequential(nn.Linear(2, 2), torch.nn.ReLU()))


def test_targets_peft_renames_to_experts_a_model_without_them_does_not_have_are_refused():
    from conftest import tiny_moe

    from fora_plugin.targets import check_target_modules

    config = tiny_moe(2, num_experts=2).config
    config.num_experts = 0  # every MLP dense: gate_proj, up_proj and down_proj are modules, not fused experts
    check_target_modules(config, ["q_proj", "v_proj"], key="lora_target_modules")
    with pytest.raises(FoRAInputError, match=r"PEFT renames \['gate_proj', 'up_proj'\] for every 'qwen3_moe' model"):
        check_target_modules(config, ["q_proj", "gate_proj", "up_proj"], key="lora_target_modules")


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
