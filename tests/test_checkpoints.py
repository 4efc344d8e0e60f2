"""fora_plugin.checkpoints: ``resume_from_checkpoint`` names a checkpoint folder (one with trainer_state.json), and a
checkpoint resumes only with the LoRA settings its adapter_config.json was saved with."""

import json
from types import SimpleNamespace

import pytest

from fora_plugin.checkpoints import check_checkpoint, check_resumed_adapter


def model_args(**changes):
    args = {
        "lora_r": 16,
        "lora_alpha": 32,
        "use_dora": False,
        "use_rslora": False,
        "lora_target_modules": ["q_proj", "v_proj"],
        "lora_target_parameters": None,
    }
    return SimpleNamespace(**{**args, **changes})


def checkpoint(tmp_path, **saved):
    config = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"], **saved}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_settings_it_was_trained_with_resume(tmp_path):
    check_resumed_adapter(checkpoint(tmp_path), model_args())
    # FoRA saves the fully qualified names of the chosen layers' modules.
    check_resumed_adapter(
        checkpoint(tmp_path, target_modules=["model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.v_proj"]),
        model_args(),
    )
    # PEFT saves fused MoE expert targets under their fused names.
    moe = checkpoint(tmp_path, target_modules=["q_proj"], target_parameters=["down_proj", "gate_up_proj"])
    targets = ["q_proj", "gate_proj", "up_proj", "down_proj"]
    check_resumed_adapter(moe, model_args(lora_target_modules=targets), "qwen3_moe")
    check_resumed_adapter(checkpoint(tmp_path), model_args(lora_target_modules="all-linear"))  # not comparable
    check_resumed_adapter(str(tmp_path / "none"), model_args(lora_r=4))  # no adapter_config.json: the trainer's


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lora_r": 8}, r"lora_r=8 is invalid: checkpoint .* was trained with lora_r 16"),
        ({"lora_alpha": 16}, r"lora_alpha=16 is invalid: .* trained with lora_alpha 32"),
        ({"use_rslora": True}, r"use_rslora=True is invalid: .* trained with use_rslora False"),
        ({"use_dora": True}, r"use_dora=True is invalid"),
        (
            {"lora_target_modules": ["q_proj", "k_proj", "v_proj"]},
            r"lora_target_modules=\['k_proj', 'q_proj', 'v_proj'\] is invalid: .* lora_target_modules "
            r"\['q_proj', 'v_proj'\]",
        ),
    ],
)
def test_other_settings_are_refused_naming_both(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        check_resumed_adapter(checkpoint(tmp_path), model_args(**changes))


def test_checkpoint_is_a_folder_with_trainer_state(tmp_path):
    check_checkpoint(None, str(tmp_path))
    check_checkpoint("false", str(tmp_path))
    with pytest.raises(ValueError, match=r"resume_from_checkpoint=True but output_dir .* holds no checkpoint"):
        check_checkpoint("true", str(tmp_path))
    run = tmp_path / "run"
    (run / "checkpoint-4").mkdir(parents=True)
    (run / "checkpoint-4" / "trainer_state.json").write_text("{}")
    (run / "adapter_config.json").write_text("{}")
    check_checkpoint(True, str(run))
    check_checkpoint(str(run / "checkpoint-4"), str(tmp_path))
    with pytest.raises(ValueError, match=r"it is a saved adapter, not a checkpoint.*Resume from .*checkpoint-4"):
        check_checkpoint(str(run), str(tmp_path))
    with pytest.raises(ValueError, match=r"no such folder"):
        check_checkpoint(str(tmp_path / "nope"), str(tmp_path))
