"""FoRAConfig validation and its fora_-prefixed YAML form."""

import pytest
import yaml
from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

from fora_plugin import FoRAConfig
from fora_plugin.config import FoRAArguments


def test_defaults_are_the_papers_settings():
    config = FoRAConfig()
    assert (config.mode, config.layer_budget, config.fisher_batches, config.lr_stiefel, config.qr_period) == (
        "fora",
        0.5,
        128,
        1e-3,
        200,
    )
    assert config.selects_layers and config.uses_stiefel
    # Cayley-Adam's moments as in the paper's code (what CayleyAdam used before they were configurable).
    assert (config.stiefel_beta1, config.stiefel_beta2, config.stiefel_eps) == (0.9, 0.99, 1e-8)
    # The fast path that changes no number is on; the adapters' dtype stays what the trainer gives them.
    assert (config.input_cast, config.adapter_dtype) == ("auto", "auto")


@pytest.mark.parametrize(
    ("mode", "selects", "stiefel"),
    [("fora", True, True), ("fg-lora", True, False), ("stiefel-lora", False, True), ("lora", False, False)],
)
def test_modes_are_the_2x2_ablation(mode, selects, stiefel):
    config = FoRAConfig(mode=mode)
    assert (config.selects_layers, config.uses_stiefel) == (selects, stiefel)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "dora"}, r"mode='dora' is invalid: use one of \('fora', 'fg-lora', 'stiefel-lora', 'lora'\)"),
        ({"layer_strategy": "best"}, r"layer_strategy='best' is invalid"),
        ({"fisher_params": "all"}, r"fisher_params='all' is invalid"),
        ({"cayley_solver": "newton"}, r"cayley_solver='newton' is invalid"),
        ({"init_a": "normal"}, r"init_a='normal' is invalid"),
        ({"layer_budget": 0}, r"layer_budget=0 gives K < 1"),
        ({"layer_budget": 1.5}, r"layer_budget=1.5 is a fraction outside \(0, 1\]"),
        ({"layer_budget": "half"}, r"layer_budget='half' is invalid"),
        ({"fisher_batches": 0}, r"fisher_batches=0 is invalid: use an int >= 1"),
        ({"qr_period": -1}, r"qr_period=-1 is invalid"),
        ({"cayley_iters": 0}, r"cayley_iters=0 is invalid"),
        ({"lr_stiefel": 0.0}, r"lr_stiefel=0.0 is invalid"),
        ({"lr_stiefel": float("nan")}, r"lr_stiefel=nan is invalid: use a finite float > 0"),
        ({"lr_stiefel": float("inf")}, r"lr_stiefel=inf is invalid: use a finite float > 0"),
        ({"lr_stiefel": "1e-3"}, r"lr_stiefel='1e-3' is invalid"),
        ({"stiefel_beta1": 1.0}, r"stiefel_beta1=1.0 is invalid: use a float in \[0, 1\)"),
        ({"stiefel_beta2": float("nan")}, r"stiefel_beta2=nan is invalid: use a float in \[0, 1\)"),
        ({"stiefel_beta2": -0.1}, r"stiefel_beta2=-0.1 is invalid"),
        ({"stiefel_eps": -1e-8}, r"stiefel_eps=-1e-08 is invalid: use a finite float >= 0"),
        ({"stiefel_eps": float("inf")}, r"stiefel_eps=inf is invalid"),
        ({"layer_budget": float("nan")}, r"layer_budget=nan is invalid"),
        ({"layer_budget": "inf"}, r"layer_budget=inf is invalid"),
        ({"layers": [1, 1]}, r"layers=\[1, 1\] is invalid"),
        ({"layers": [-2]}, r"layers=\[-2\] is invalid"),
        ({"layers": [1], "mode": "lora"}, r"layers=\[1\] contradicts mode='lora'"),
        ({"layers": [1], "scores_path": "x.json"}, r"layers and scores_path are both set"),
        # pairs of which one would be ignored
        (
            {"layers": [0, 1], "layer_strategy": "random"},
            r"layer_strategy='random' is invalid: layers=\[0, 1\] is set",
        ),
        (
            {"scores_path": "x.json", "layer_strategy": "last"},
            r"layer_strategy='last' is invalid: scores_path='x\.json'",
        ),
        ({"mode": "lora", "layer_strategy": "first"}, r"layer_strategy='first' is invalid: mode='lora' adapts every"),
        ({"mode": "stiefel-lora", "scores_path": "x.json"}, r"scores_path='x\.json' is invalid: mode='stiefel-lora'"),
        ({"input_cast": "off"}, r"input_cast='off' is invalid: use one of \('auto', 'peft'\)"),
        ({"adapter_dtype": "float16"}, r"adapter_dtype='float16' is invalid: use one of \('auto', 'bfloat16'\)"),
        ({"adapter_dtype": "bfloat16", "mode": "lora"}, r"adapter_dtype='bfloat16' contradicts mode='lora'"),
    ],
)
def test_bad_values_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FoRAConfig(**kwargs)


def test_layer_budget_strings_from_the_command_line():
    assert FoRAConfig(layer_budget="8").layer_budget == 8
    assert FoRAConfig(layer_budget="0.25").layer_budget == 0.25


def test_every_field_has_help():
    import dataclasses

    assert all(f.metadata.get("help") for f in dataclasses.fields(FoRAConfig))


def test_yaml_and_overrides_through_trls_parser(tmp_path):
    config = {
        "model_name_or_path": "m",
        "output_dir": str(tmp_path),
        "bf16": False,
        "seed": 7,
        "fora_mode": "fg-lora",
        "fora_layer_budget": 3,
        "fora_fisher_batches": 16,
        "fora_stiefel_beta2": 0.995,
        "fora_stiefel_eps": 1e-6,
        "fora_adapter_dtype": "bfloat16",
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, FoRAArguments))
    overrides = ["--fora_layers", "1", "3", "--fora_input_cast", "peft"]
    *_, training, _, fora = parser.parse_args_and_config(["--config", str(path), *overrides])
    fora_config = fora.to_fora_config()
    assert training.seed == 7  # SFTConfig keeps its own seed; FoRA's is fora_seed
    assert (fora_config.mode, fora_config.layer_budget, fora_config.fisher_batches, fora_config.layers) == (
        "fg-lora",
        3,
        16,
        [1, 3],
    )
    assert (fora_config.stiefel_beta1, fora_config.stiefel_beta2, fora_config.stiefel_eps) == (0.9, 0.995, 1e-6)
    assert (fora_config.input_cast, fora_config.adapter_dtype) == ("peft", "bfloat16")
    with pytest.raises(ValueError, match=r"lr_stiefel=nan is invalid"):
        parser.parse_args_and_config(["--config", str(path), "--fora_lr_stiefel", "nan"])[-1].to_fora_config()
    with pytest.raises(SystemExit):
        parser.parse_args_and_config(["--config", str(path), "--fora_mode", "nope"])


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    from fora_plugin.recipe import load_yaml_config

    config = _yaml(tmp_path, "lora_r: 16\nlora_alpha: 32\nlora_r: 4\n")
    with pytest.raises(ValueError, match=r"c\.yaml sets 'lora_r' twice, on lines 1 and 3"):
        load_yaml_config(config)
    nested = _yaml(tmp_path, "ablation:\n  runs: [lora]\n  runs: [fora]\n")
    with pytest.raises(ValueError, match=r"sets 'runs' twice, on lines 2 and 3"):
        load_yaml_config(nested)


def test_parse_config_names_unknown_keys_with_the_closest_known_one_and_no_list(tmp_path):
    from fora_plugin.recipe import parse_config

    config = _yaml(tmp_path, f"output_dir: {tmp_path}\nlerning_rate: 0.1\n")
    with pytest.raises(ValueError, match=r"unknown keys \['lerning_rate'\].*did you mean learning_rate\?$") as info:
        parse_config(config, [])
    assert "fail_with_unknown_args" not in str(info.value) and "max_steps" not in str(info.value)
    config = _yaml(tmp_path, f"output_dir: {tmp_path}\n")
    with pytest.raises(ValueError, match=r"unknown overrides \['--fora_layer_budgett'\]") as info:
        parse_config(config, ["--max_steps", "3", "--fora_layer_budgett", "2"])
    assert "max_steps" not in str(info.value)


def test_parse_config_reports_a_bad_choice_in_one_line_without_the_usage(tmp_path):
    from fora_plugin.recipe import parse_config

    config = _yaml(tmp_path, f"output_dir: {tmp_path}\n")
    with pytest.raises(ValueError, match=r"^--fora_mode on the command line: invalid choice: 'foraa'") as info:
        parse_config(config, ["--fora_mode", "foraa"])
    assert "usage" not in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "message"),
    [
        ("lora_r: 0\n", [], r"lora_r=0 is invalid"),
        ("", ["--lora_alpha", "0"], r"lora_alpha=0 is invalid: .*the adapter does nothing"),
        ("warmup_steps: -3\n", [], r"warmup_steps=-3 is invalid"),  # before TrainingArguments' own wording
        ("", ["--per_device_train_batch_size", "0"], r"per_device_train_batch_size=0 is invalid"),
    ],
)
def test_parse_config_checks_the_numbers(tmp_path, yaml_text, overrides, message):
    from fora_plugin.recipe import parse_config

    with pytest.raises(ValueError, match=message):
        parse_config(_yaml(tmp_path, f"output_dir: {tmp_path}\nbf16: false\n{yaml_text}"), overrides)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"layers": [0, 1]},
        {"scores_path": "x.json"},
        {"layer_strategy": "random"},
        {"mode": "fg-lora", "layer_strategy": "last"},
        {"mode": "lora"},
    ],
)
def test_each_way_of_choosing_the_layers_alone_is_accepted(kwargs):
    assert FoRAConfig(**kwargs).mode == kwargs.get("mode", "fora")
