"""Every shipped config parses into valid SFT, LoRA and FoRA settings."""

import warnings
from pathlib import Path

import pytest
import yaml

from fora_plugin.ablate import RUNS, load_ablation_config
from fora_plugin.recipe import parse_config


EXAMPLES = Path(__file__).parent.parent / "example_configs"
CONFIGS = sorted(p for p in EXAMPLES.glob("*.yaml") if "ablation" not in yaml.safe_load(p.read_text()))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_parses(path):
    overrides = ["--bf16", "false", "--use_cpu", "true"]  # bf16 is refused on a CPU-only host
    script_args, training_args, model_args, fora_config = parse_config(str(path), overrides)
    assert script_args.dataset_name and model_args.model_name_or_path
    assert model_args.lora_target_modules and fora_config.mode in ("fora", "fg-lora", "stiefel-lora", "lora")


def test_paper_configs_use_the_papers_settings():
    for name in ("commonsense_llama3_8b.yaml", "alpaca_llama2_7b.yaml"):
        _, training, model, fora = parse_config(
            str(Path(__file__).parent.parent / "example_configs" / name), ["--bf16", "false", "--use_cpu", "true"]
        )
        assert (model.lora_r, model.lora_alpha) == (32, 64)
        assert sorted(model.lora_target_modules) == sorted(["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"])
        assert (training.learning_rate, fora.lr_stiefel, training.weight_decay) == (2e-4, 1e-3, 0.01)
        assert (training.per_device_train_batch_size, training.gradient_accumulation_steps) == (16, 4)
        assert (training.num_train_epochs, training.max_length) == (3, 256)
        assert (fora.layer_budget, fora.fisher_batches, fora.qr_period) == (0.5, 128, 200)


def test_ablation_config_trains_the_whole_grid_on_bundled_data(tmp_path):
    training, block = load_ablation_config(str(EXAMPLES / "ablation_gemma270m.yaml"))
    assert block["runs"] == list(RUNS)
    assert Path(training["dataset_name"]).is_file() and Path(block["eval"]["kl_text"]).is_file()
    for task in block["eval"]["tasks"]:
        assert (Path(block["eval"]["commonsense_dir"]) / task / "test.json").is_file()
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(training))
    *_, fora = parse_config(str(path), ["--bf16", "false", "--use_cpu", "true"])
    assert fora.layer_budget == 0.5


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_parses_without_deprecation_warnings(path):
    # What the user sees first: no FutureWarning about a key our own configs set (e.g. gradient_checkpointing).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_config(str(path), ["--bf16", "false", "--use_cpu", "true"])
    deprecated = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert deprecated == []


def test_the_axolotl_readmes_usage_block_is_the_axolotl_quickstart_config():
    readme = (Path(__file__).parent.parent / "fora_plugin" / "axolotl" / "README.md").read_text()
    (block,) = [b for b in readme.split("```yaml\n")[1:] if "plugins:" in b]
    shown = yaml.safe_load(block.split("```")[0])
    assert shown == yaml.safe_load((EXAMPLES / "axolotl" / "quickstart.yaml").read_text())
