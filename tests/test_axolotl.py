"""The Axolotl plugin through real `axolotl train` runs on a tiny local Llama, and its config validation."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest


pytest.importorskip("axolotl", reason="axolotl is not installed: it has a virtualenv of its own (.ci/run)")

import torch  # noqa: E402
import yaml  # noqa: E402
from axolotl.integrations.base import BasePlugin  # noqa: E402
from axolotl.utils.config import validate_config  # noqa: E402
from axolotl.utils.dict import DictDefault  # noqa: E402
from conftest import TARGETS, char_tokenizer, readme_code, tiny_llama  # noqa: E402
from datasets import load_from_disk  # noqa: E402
from pydantic import ValidationError  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402

from fora_plugin import FoRAConfig  # noqa: E402
from fora_plugin.axolotl import PLUGIN_NAME, FoRAArgs, FoRAPlugin  # noqa: E402
from fora_plugin.axolotl.args import fora_config_from, fora_enabled  # noqa: E402
from fora_plugin.backward import BackwardStopCallback, lowest_adapted_layer  # noqa: E402
from fora_plugin.fisher import fisher_scores  # noqa: E402
from fora_plugin.stiefel import orthogonality_error  # noqa: E402


LAYERS = 4
FISHER_BATCHES = 3
LR, LR_STIEFEL = 1e-2, 5e-2
# The README's Axolotl lines (the plugin, `adapter: lora`, its fora_* keys): every FoRA run below is built on them.
README_LINES = yaml.safe_load(readme_code("yaml", PLUGIN_NAME))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("axolotl")
    tiny_llama(LAYERS, vocab_size=99).save_pretrained(root / "model")
    char_tokenizer().save_pretrained(root / "model")
    rows = [
        {"instruction": f"Add {a} and {b}.", "input": "", "output": str(a + b)} for a in range(6) for b in range(6)
    ]
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def lora_config(root: Path, name: str, **overrides) -> dict:
    """The YAML of a plain Axolotl LoRA run; the FoRA runs add the plugin and fora_* keys to it."""
    config = {
        "base_model": str(root / "model"),
        "datasets": [{"path": str(root / "data.jsonl"), "type": "alpaca", "ds_type": "json"}],
        "dataset_prepared_path": str(root / "prepared"),
        "dataset_num_proc": 1,
        # Rows in file order, batches in dataset order: the test can rebuild the scoring batches.
        "shuffle_merged_datasets": False,
        "curriculum_sampling": True,
        "output_dir": str(root / name),
        "adapter": "lora",
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "lora_target_modules": list(TARGETS),
        "sequence_len": 256,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "max_steps": 2,
        "learning_rate": LR,
        "optimizer": "adamw_torch",
        "lr_scheduler": "cosine",
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": 1,
        "bf16": False,
        "fp16": False,
        "tf32": False,
        "seed": 0,
    }
    config.update(overrides)
    return config


def fora_config(root: Path, name: str, **overrides) -> dict:
    """The README's Axolotl lines on the plain LoRA run, as written but for its scoring batches (the tiny dataset
    has 36 rows) and lora_B's rate (2 steps must move it)."""
    fora = {**README_LINES, "fora_fisher_batches": FISHER_BATCHES, "fora_lr_stiefel": LR_STIEFEL}
    return lora_config(root, name, **{**fora, **overrides})


def axolotl_train(root: Path, config: dict, *args: str, check: bool = True) -> str:
    """Run `axolotl train` on ``config`` (written next to its output_dir) and return its output."""
    path = root / f"{Path(config['output_dir']).name}.yaml"
    path.write_text(yaml.safe_dump(config))
    bin_dir = Path(sys.executable).parent  # axolotl execs accelerate from the same environment
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(root / "hf-datasets"),
        "AXOLOTL_DO_NOT_TRACK": "1",
        "WANDB_MODE": "disabled",
        # ProbePlugin below is loaded from this file by its dotted path.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [str(bin_dir / "axolotl"), "train", str(path), *args], env=env, capture_output=True, text=True
    )
    output = result.stdout + result.stderr
    if check and result.returncode != 0:
        pytest.fail(f"axolotl train {path.name} failed ({result.returncode}):\n{output[-4000:]}")
    return output


def adapted_layers(keys) -> set[int]:
    return {int(k.split(".layers.")[1].split(".")[0]) for k in keys}


def log_history(output_dir: Path, step: int) -> list[dict]:
    return json.loads((output_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())["log_history"]


@pytest.fixture(scope="module")
def fora_run(workspace):
    output = axolotl_train(workspace, fora_config(workspace, "fora"))
    return workspace / "fora", output


# --------------------------------------------------------------------------------------------- real FoRA runs
def test_lora_sits_on_exactly_the_k_chosen_layers_and_b_is_orthonormal(fora_run):
    out, output = fora_run
    selection = json.loads((out / "fora_scores.json").read_text())
    scores = selection["scores"]
    assert selection["k"] == LAYERS // 2 and selection["source"] == "fisher"
    assert selection["chosen_layers"] == sorted(sorted(range(LAYERS), key=lambda i: -scores[i])[: LAYERS // 2])
    chosen = selection["chosen_layers"]

    expected = sorted(
        f"model.layers.{i}.{'self_attn' if t[0] in 'qkv' else 'mlp'}.{t}" for i in chosen for t in TARGETS
    )
    assert sorted(json.loads((out / "adapter_config.json").read_text())["target_modules"]) == expected
    weights = load_file(out / "adapter_model.safetensors")
    assert len(weights) == 2 * len(expected) and adapted_layers(weights) == set(chosen)
    lora_b = [w for k, w in weights.items() if "lora_B" in k]
    assert max(orthogonality_error(b).item() for b in lora_b) < 1e-4

    assert (out / "fora_scores.png").read_bytes()[:4] == b"\x89PNG"
    assert "| layer | Fisher score | trainable params |" in output
    assert "Patched attention class with LoRA optims" not in output  # the plugin turned Axolotl's kernels off


def test_scores_are_fisher_scores_of_the_training_batches(fora_run, workspace):
    out, _ = fora_run
    (prepared,) = [p for p in (workspace / "prepared").iterdir() if p.is_dir()]
    rows = load_from_disk(str(prepared)).select(range(FISHER_BATCHES))
    batches = [{k: torch.tensor([row[k]]) for k in ("input_ids", "attention_mask", "labels")} for row in rows]
    assert all((b["labels"] == -100).any() for b in batches)  # Axolotl masks the prompts: the training loss
    base = AutoModelForCausalLM.from_pretrained(workspace / "model", dtype=torch.float32)
    reference = fisher_scores(base, batches, FISHER_BATCHES, progress=False)
    saved = json.loads((out / "fora_scores.json").read_text())
    assert saved["num_batches"] == FISHER_BATCHES
    assert saved["scores"] == pytest.approx(reference.scores, rel=1e-4)


def test_the_optimizer_has_the_stiefel_group_and_the_logs_show_it(fora_run):
    out, _ = fora_run
    selection = json.loads((out / "fora_scores.json").read_text())
    groups = torch.load(out / "checkpoint-1" / "optimizer.pt", weights_only=False)["param_groups"]
    (stiefel,) = [g for g in groups if g.get("stiefel")]
    assert len(stiefel["params"]) == len(selection["chosen_layers"]) * len(TARGETS)
    assert stiefel["initial_lr"] == LR_STIEFEL and {g["initial_lr"] for g in groups if g is not stiefel} == {LR}
    # One schedule over both groups: the cosine has scaled every group by the same factor.
    factors = {round(g["lr"] / g["initial_lr"], 12) for g in groups}
    assert len(factors) == 1 and 0 < factors.pop() < 1
    history = log_history(out, 2)
    losses = [entry for entry in history if "loss" in entry]
    assert len(losses) == 2
    assert all(
        entry["fora/max_orthogonality_error"] < 1e-4 and "fora/mean_effective_rank" in entry for entry in losses
    )
    assert losses[0]["fora/layers_adapted"] == 2 and losses[0]["fora/parameter_ratio_vs_lora_all"] == 0.5
    saved = json.loads((out / "checkpoint-1" / "fora_scores.json").read_text())
    assert saved["chosen_layers"] == selection["chosen_layers"]


def test_resume_reuses_the_selection_and_the_optimizer_state(fora_run, workspace):
    out, _ = fora_run
    resumed = workspace / "resumed"
    shutil.copytree(out, resumed)
    config = fora_config(workspace, "resumed", max_steps=3, auto_resume_from_checkpoints=True)
    output = axolotl_train(workspace, config)
    assert "resume from checkpoint at" in output and "Fisher scoring" not in output
    selection = json.loads((resumed / "fora_scores.json").read_text())
    assert selection["source"] == "checkpoint"
    assert selection["chosen_layers"] == json.loads((out / "fora_scores.json").read_text())["chosen_layers"]
    optimizer = torch.load(resumed / "checkpoint-3" / "optimizer.pt", weights_only=False)
    (stiefel,) = [g for g in optimizer["param_groups"] if g.get("stiefel")]
    assert stiefel["steps"] == 3  # 2 restored + 1: Cayley-Adam's state came back with the checkpoint
    assert all(optimizer["state"][i]["step"].item() == 3 for i in stiefel["params"])
    assert adapted_layers(load_file(resumed / "adapter_model.safetensors")) == set(selection["chosen_layers"])


@pytest.fixture(scope="module")
def plain_runs(workspace):
    """The FoRA YAML without the plugin line, and with the plugin but fora_mode: lora."""
    absent = fora_config(workspace, "absent")
    del absent["plugins"]
    return {
        "absent": (workspace / "absent", axolotl_train(workspace, absent)),
        "disabled": (
            workspace / "disabled",
            axolotl_train(workspace, fora_config(workspace, "disabled", fora_mode="lora")),
        ),
    }


def test_without_the_plugin_or_disabled_axolotl_trains_plain_lora_on_every_layer(plain_runs):
    for out, output in plain_runs.values():
        assert not (out / "fora_scores.json").exists() and "Fisher scoring" not in output
        assert adapted_layers(load_file(out / "adapter_model.safetensors")) == set(range(LAYERS))
        groups = torch.load(out / "checkpoint-2" / "optimizer.pt", weights_only=False)["param_groups"]
        assert not any(g.get("stiefel") for g in groups)
        assert sum(len(g["params"]) for g in groups) == 2 * LAYERS * len(TARGETS)
        assert not any(key.startswith("fora/") for entry in log_history(out, 2) for key in entry)
    (absent, absent_output), (disabled, _) = plain_runs["absent"], plain_runs["disabled"]
    assert [e.get("loss") for e in log_history(absent, 2)] == [e.get("loss") for e in log_history(disabled, 2)]
    a, b = load_file(absent / "adapter_model.safetensors"), load_file(disabled / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Installed, the plugin is registered for every run: it says why it does nothing.
    assert any(point.value == "fora_plugin.axolotl:FoRAPlugin" for point in entry_points(group="axolotl.plugins"))
    assert f"are set but `plugins` does not list {PLUGIN_NAME}: FoRA is off" in absent_output


def test_a_bad_value_stops_axolotl_train_before_loading_anything(workspace):
    config = fora_config(workspace, "bad", fora_layer_budget=1.5)
    output = axolotl_train(workspace, config, "--launcher", "python", check=False)
    assert "fora_layer_budget=1.5 is a fraction outside (0, 1]" in output
    assert not (workspace / "bad" / "adapter_model.safetensors").exists()


# ----------------------------------------------------------------------------------------------- validation
def validate(workspace, **overrides) -> DictDefault:
    """Axolotl's own config validation, with the plugin's args merged into the schema."""
    return validate_config(DictDefault(fora_config(workspace, "validate", **overrides)))


def test_the_fora_keys_are_foraconfig_fields_with_its_help():
    fields = dataclasses.fields(FoRAConfig)
    assert set(FoRAArgs.model_fields) == {f"fora_{f.name}" for f in fields}
    for f in fields:
        assert FoRAArgs.model_fields[f"fora_{f.name}"].description == f.metadata["help"]
    assert fora_config_from(FoRAArgs().model_dump()) == FoRAConfig()
    assert FoRAPlugin().get_input_args() == "fora_plugin.axolotl.args.FoRAArgs"


def test_the_readmes_axolotl_lines_enable_fora_with_their_values(workspace):
    assert README_LINES["plugins"] == [PLUGIN_NAME] and README_LINES["adapter"] == "lora"
    config = lora_config(workspace, "readme")
    cfg = validate_config(DictDefault({**config, **README_LINES}))  # as written
    assert fora_enabled(cfg)
    assert fora_config_from(cfg) == FoRAConfig(layer_budget=0.5, fisher_batches=128, lr_stiefel=1e-3)


def test_valid_fora_keys_reach_the_config(workspace):
    cfg = validate(workspace, fora_layer_budget=3, fora_mode="fg-lora", fora_cayley_solver="fixed_point")
    assert fora_config_from(cfg) == FoRAConfig(
        mode="fg-lora",
        layer_budget=3,
        fisher_batches=FISHER_BATCHES,
        lr_stiefel=LR_STIEFEL,
        cayley_solver="fixed_point",
    )


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("fora_layer_budget", 1.5, r"fora_layer_budget=1.5 is a fraction outside \(0, 1\]"),
        ("fora_layer_budget", "half", r"fora_layer_budget='half' is invalid: use a fraction in \(0, 1\] or an int K"),
        ("fora_mode", "fisher", r"fora_mode='fisher' is invalid: use one of \('fora', 'fg-lora'"),
        ("fora_fisher_batches", 0, r"fora_fisher_batches=0 is invalid: use an int >= 1"),
        ("fora_fisher_batches", "many", r"fora_fisher_batches\n.*valid integer.*input_value='many'"),
        ("fora_lr_stiefel", -1.0, r"fora_lr_stiefel=-1.0 is invalid: use a finite float > 0"),
        ("fora_layers", [1, 1], r"fora_layers=\[1, 1\] is invalid: use distinct 0-based layer indices"),
        ("fora_cayley_solver", "newton", r"fora_cayley_solver='newton' is invalid"),
    ],
)
def test_bad_fora_values_fail_validation_naming_key_and_value(workspace, key, value, match):
    with pytest.raises(ValidationError, match=match):
        validate(workspace, **{key: value})
    with pytest.raises(ValidationError, match=match):
        FoRAArgs(**{key: value})


def test_contradicting_fora_keys_fail_naming_both(workspace):
    with pytest.raises(ValidationError, match=r"fora_layers=\[0\] contradicts fora_mode='stiefel-lora'"):
        validate(workspace, fora_layers=[0], fora_mode="stiefel-lora")


def deepspeed_file(tmp_path, **config) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


REFUSED = [
    ({"lora_qkv_kernel": True}, r"lora_qkv_kernel=True cannot be combined with FoRA: .* no gradient for the base"),
    ({"peft_layers_to_transform": [0, 1]}, r"peft_layers_to_transform=\[0, 1\] is set, but FoRA chooses the layers"),
    ({"peft_use_dora": True}, r"peft_use_dora=True cannot be combined with fora_mode='fora'"),
    ({"lora_model_dir": "some/adapter"}, r"lora_model_dir='some/adapter' loads a trained adapter"),
    ({"optimizer": "adamw_bnb_8bit"}, r"optimizer='adamw_bnb_8bit' cannot be combined with FoRA"),
    ({"loraplus_lr_ratio": 16.0}, r"loraplus_lr_ratio=16.0: these regroup the optimizer's parameters"),
    (
        {"fsdp_config": {"fsdp_version": 2, "cpu_ram_efficient_loading": True}},
        r"cpu_ram_efficient_loading=True loads the weights on the first rank only",
    ),
    (
        {"peft_init_lora_weights": "pissa"},
        r"peft_init_lora_weights='pissa' cannot be combined with fora_mode='fora': it subtracts the initial adapter",
    ),
    (
        {"peft": {"loftq_config": {"loftq_bits": 4}}},
        r"peft.loftq_config \(loftq_bits=4\) sets init_lora_weights='loftq' cannot be combined with fora_mode",
    ),
    ({"learning_rate": float("nan")}, r"learning_rate=nan is invalid: use a finite float >= 0"),
    ({"learning_rate": "inf"}, r"learning_rate=inf is invalid: use a finite float >= 0"),
]
DEEPSPEED_REFUSED = [
    ("fora", {"zero_optimization": {"stage": 0}}, r"has zero_optimization.stage=0: .* under ZeRO-1, 2 and 3"),
    ("fora", {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}, r"has an `optimizer` block"),
    (
        "fora",
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        r"offloads the optimizer to 'cpu' with zero_force_ds_cpu_optimizer true",
    ),
    ("fora", {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}, r"enables fp16"),
]


@pytest.mark.parametrize(("settings", "match"), REFUSED)
def test_settings_fora_cannot_be_right_with_are_refused_with_the_fix(workspace, settings, match):
    with pytest.raises(ValidationError, match=match):
        validate(workspace, **settings)
    validate(workspace, **settings, fora_mode="lora")  # disabled: Axolotl's own behaviour, nothing refused


@pytest.mark.parametrize(("mode", "deepspeed", "match"), DEEPSPEED_REFUSED)
def test_deepspeed_configs_fora_cannot_be_right_with_are_refused(workspace, tmp_path, mode, deepspeed, match):
    with pytest.raises(ValidationError, match=match):
        validate(workspace, fora_mode=mode, deepspeed=deepspeed_file(tmp_path, **deepspeed))


DEEPSPEED_CONFIGS = sorted((Path(__file__).parent.parent / "example_configs" / "deepspeed").glob("*.json"))


@pytest.mark.parametrize("path", DEEPSPEED_CONFIGS, ids=[p.name for p in DEEPSPEED_CONFIGS])
def test_shipped_deepspeed_configs_are_accepted(workspace, path):
    validate(workspace, deepspeed=str(path))


def test_deepspeed_zero2_is_accepted(workspace, tmp_path):
    validate(workspace, deepspeed=deepspeed_file(tmp_path, zero_optimization={"stage": 2}))
    # fg-lora has no Stiefel lora_B: DeepSpeed's own optimizer is AdamW as FoRA's would be.
    optimizer_block = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}
    validate(workspace, fora_mode="fg-lora", deepspeed=deepspeed_file(tmp_path, **optimizer_block))


@pytest.fixture(scope="module")
def qfora_run(workspace):
    config = fora_config(workspace, "qfora", adapter="qlora", load_in_4bit=True, max_steps=4, save_steps=4)
    output = axolotl_train(workspace, config)
    return workspace / "qfora", output


@pytest.mark.slow
def test_qlora_run_is_qfora_on_the_chosen_layers(qfora_run):
    out, _ = qfora_run
    selection = json.loads((out / "fora_scores.json").read_text())
    weights = load_file(out / "adapter_model.safetensors")
    assert len(selection["chosen_layers"]) == LAYERS // 2
    assert adapted_layers(weights) == set(selection["chosen_layers"])
    for key, value in weights.items():
        if "lora_B" in key:
            assert orthogonality_error(value.float()) < 1e-2, key  # saved in the adapter dtype
    assert all(score > 0 for score in selection["scores"])


def test_the_plugin_is_enabled_by_its_dotted_or_entry_point_name_only():
    assert fora_enabled({"plugins": ["fora_plugin.axolotl.FoRAPlugin"]})
    assert fora_enabled({"plugins": ["fora_plugin.axolotl:FoRAPlugin"]})
    assert not fora_enabled({"plugins": ["axolotl.integrations.liger.LigerPlugin"]}) and not fora_enabled({})
    assert PLUGIN_NAME == f"{FoRAPlugin.__module__}.{FoRAPlugin.__qualname__}"


def test_register_turns_the_lora_kernels_off_only_when_enabled(workspace):
    kernels = ("lora_qkv_kernel", "lora_o_kernel", "lora_mlp_kernel")
    enabled = DictDefault(fora_config(workspace, "register", lora_o_kernel=False))
    FoRAPlugin().register(enabled)
    assert [enabled[k] for k in kernels] == [False, False, False]
    for cfg in (
        DictDefault(lora_config(workspace, "register")),
        DictDefault(fora_config(workspace, "r", fora_mode="lora")),
    ):
        FoRAPlugin().register(cfg)
        assert all(cfg.get(k) is None for k in kernels)  # Axolotl decides, as without the plugin


AXOLOTL_CONFIGS = sorted((Path(__file__).parent.parent / "example_configs" / "axolotl").glob("*.yaml"))


@pytest.mark.parametrize("path", AXOLOTL_CONFIGS, ids=[p.name for p in AXOLOTL_CONFIGS])
def test_shipped_axolotl_configs_validate_with_the_plugin_on(path):
    cfg = validate_config(DictDefault(yaml.safe_load(path.read_text())))
    assert fora_enabled(cfg) and fora_config_from(cfg).mode == "fora"


def test_paper_configs_use_the_papers_settings():
    for name in ("alpaca_llama2_7b.yaml", "commonsense_llama3_8b.yaml"):
        cfg = validate_config(DictDefault(yaml.safe_load((AXOLOTL_CONFIGS[0].parent / name).read_text())))
        fora = fora_config_from(cfg)
        assert (cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == (32, 64, 0.0)
        assert sorted(cfg.lora_target_modules) == sorted(TARGETS)
        assert (cfg.learning_rate, fora.lr_stiefel, cfg.weight_decay) == (2e-4, 1e-3, 0.01)
        assert (cfg.micro_batch_size, cfg.gradient_accumulation_steps, cfg.num_epochs) == (16, 4, 3)
        assert (cfg.sequence_len, cfg.bf16) == (256, True)
        assert (fora.layer_budget, fora.fisher_batches, fora.qr_period) == (0.5, 128, 200)


def test_qfora_config_loads_a_4bit_nf4_base():
    path = AXOLOTL_CONFIGS[0].parent / "qfora_llama3_8b.yaml"
    cfg = validate_config(DictDefault(yaml.safe_load(path.read_text())))
    assert (cfg.adapter, cfg.load_in_4bit, cfg.bf16) == ("qlora", True, True)
    assert cfg.bnb_config_kwargs["bnb_4bit_quant_type"] == "nf4" and cfg.bnb_config_kwargs["bnb_4bit_use_double_quant"]


# ------------------------------------------------------------------------------------ scoring runs like training
class ProbePlugin(BasePlugin):
    """Listed after FoRA in a run's plugins: records every forward inside decoder layer 0 (autocast on, its dtype).

    Under activation checkpointing the inside of a layer runs twice per batch (forward, then recompute). FoRA scores
    in its post_trainer_create, which runs before this plugin's: the calls up to then are the scoring ones.
    """

    def get_training_args(self, cfg):
        return {"use_cpu": True}  # Axolotl has no key for it, and transformers refuses bf16 without it on a CPU

    def post_model_build(self, cfg, model):
        self.calls = []
        model.model.layers[0].mlp.register_forward_pre_hook(self.record)

    def record(self, module, args):
        autocast = torch.is_autocast_enabled("cpu")
        self.calls.append([autocast, str(torch.get_autocast_dtype("cpu")) if autocast else None])

    def post_trainer_create(self, cfg, trainer):
        self.scoring, self.calls = self.calls, []
        self.lowest = lowest_adapted_layer(trainer.model)

    def post_train(self, cfg, model):
        record = {"scoring": self.scoring, "training": self.calls, "lowest_adapted": self.lowest}
        (Path(cfg.output_dir) / "probe.json").write_text(json.dumps(record))


def test_axolotl_scoring_runs_with_the_checkpointing_and_autocast_of_a_training_step(workspace):
    config = fora_config(
        workspace,
        "probe",
        plugins=[PLUGIN_NAME, f"{__name__}.ProbePlugin"],
        bf16=True,  # the model is stored in fp32: bf16 comes from the autocast only
        gradient_checkpointing=True,
    )
    axolotl_train(workspace, config)
    record = json.loads((workspace / "probe" / "probe.json").read_text())
    # Scoring: forward + recompute of every layer. Training recomputes layer 0 only if LoRA is on it: the backward
    # stops at the lowest adapted layer.
    per_step = 2 if record["lowest_adapted"] == 0 else 1
    assert len(record["scoring"]) == 2 * FISHER_BATCHES and len(record["training"]) == 2 * per_step
    assert (
        {tuple(c) for c in record["scoring"]} == {tuple(c) for c in record["training"]} == {(True, "torch.bfloat16")}
    )


# ---------------------------------------------------------------------- the backward stops at the lowest adapted layer
BELOW = 2  # fora_layers [2, 3] of 4: the embeddings and layers 0 and 1 lie below


class BackwardProbePlugin(BasePlugin):
    """Listed after FoRA: counts the backward calls of every module below layer 2 and the forwards of layer 0's MLP
    (2 per step when the layer is recomputed), and keeps the first step's gradients, in ``backward_probe.pt``."""

    undo = False

    def get_training_args(self, cfg):
        return {"use_cpu": True}

    def post_trainer_create(self, cfg, trainer):
        if self.undo:  # the behaviour before: FoRA's stop taken off, Trainer.train's embeddings hook stays
            (callback,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, BackwardStopCallback)]
            callback.stop.remove()
            trainer.remove_callback(callback)
        base = trainer.model.get_base_model()
        below = {"embed_tokens": base.model.embed_tokens}
        for i in range(BELOW):
            below |= {f"layers.{i}.{n}".rstrip("."): m for n, m in base.model.layers[i].named_modules()}
        self.backward, self.mlp_forwards, self.grads = {}, 0, {}
        for name, module in below.items():
            module.register_full_backward_hook(lambda m, gi, go, name=name: self._count(name))
        base.model.layers[0].mlp.register_forward_pre_hook(self._count_mlp)
        probe = self

        class Grads(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                if not probe.grads:
                    probe.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        trainer.add_callback(Grads())

    def _count(self, name):
        self.backward[name] = self.backward.get(name, 0) + 1

    def _count_mlp(self, module, args):
        self.mlp_forwards += 1

    def post_train(self, cfg, model):
        record = {"backward": self.backward, "mlp_forwards": self.mlp_forwards, "grads": self.grads}
        torch.save(record, Path(cfg.output_dir) / "backward_probe.pt")


class BackwardProbeWithoutStopPlugin(BackwardProbePlugin):
    undo = True


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_axolotl_backward_stops_at_the_lowest_adapted_layer_with_the_same_lora_grads(workspace, reentrant):
    records = {}
    for probe in ("BackwardProbePlugin", "BackwardProbeWithoutStopPlugin"):
        name = f"backward-{reentrant}-{probe}"
        config = fora_config(
            workspace,
            name,
            plugins=[PLUGIN_NAME, f"{__name__}.{probe}"],
            fora_layers=[2, 3],
            fora_init_a="gaussian",  # with A = 0 every lora_B gradient is zero
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": reentrant},
            max_grad_norm=0.0,  # the gradients as the backward left them
            max_steps=1,
        )
        axolotl_train(workspace, config)
        records[probe] = torch.load(workspace / name / "backward_probe.pt")
    stop, old = records["BackwardProbePlugin"], records["BackwardProbeWithoutStopPlugin"]
    assert stop["backward"] == {} and stop["mlp_forwards"] == 1
    assert old["backward"] and old["mlp_forwards"] == 2  # the counters see the old behaviour's backward below
    assert stop["grads"].keys() == old["grads"].keys() and len(old["grads"]) == 2 * 2 * len(TARGETS)
    for name, grad in old["grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(stop["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_entry_point_name_stops_the_run_with_the_dotted_name(workspace):
    assert any(point.name == "fora" for point in entry_points(group="axolotl.plugins"))
    config = fora_config(workspace, "short", plugins=["fora"])
    output = axolotl_train(workspace, config, "--launcher", "python", check=False)
    line = "plugins: [fora] cannot be loaded: Axolotl 0.21 loads plugins by their dotted path. Write plugins: [{}]."
    assert line.format(PLUGIN_NAME) in output.splitlines()
    assert "Traceback" not in output and not (workspace / "short").exists()


# What Axolotl itself takes without a check, refused by the plugin's args when the YAML enables it.
USER_INPUT_REFUSED = [
    ({"lora_r": 0}, r"lora_r=0 is invalid: use an int >= 1"),
    ({"lora_alpha": 0}, r"lora_alpha=0 is invalid: .*the adapter does nothing"),
    ({"lora_dropout": 1.5}, r"lora_dropout=1.5 is invalid: use a probability in \[0, 1\)"),
    ({"micro_batch_size": 0}, r"micro_batch_size=0 is invalid"),
    ({"lora_target_modules": ["q_proj", "qkv_proj"]}, r"the model has no module named \['qkv_proj'\]"),
    ({"lora_target_modules": "q_proj,v_proj"}, r"'q_proj,v_proj' is one name holding several"),
    ({"fora_scores_path": "/nonexistent/fora_scores.json"}, r"fora_scores_path='/nonexistent/fora_scores\.json'"),
    ({"output_dir": "/proc/fora-read-only/out"}, r"output_dir='/proc/fora-read-only/out' is invalid: .* not writable"),
]


@pytest.mark.parametrize(("settings", "match"), USER_INPUT_REFUSED)
def test_user_input_axolotl_takes_unchecked_is_refused_by_name(workspace, settings, match):
    with pytest.raises(ValidationError, match=match):
        validate(workspace, **settings)
    with pytest.raises(ValidationError, match=match):
        validate(workspace, **settings, fora_mode="lora")  # a mistake in any mode


# --------------------------------------------------------------------------------------------------- the fast path
class FastPathProbePlugin(BasePlugin):
    """Listed after FoRA: what the last training forward left on the LoRA layers (PEFT's input cast) and the
    adapters' dtypes, in ``fast_path.json``."""

    def get_training_args(self, cfg):
        return {"use_cpu": True}  # transformers refuses bf16 on a CPU without it

    def post_train(self, cfg, model):
        from peft.tuners.lora import Linear as LoraLinear

        layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
        record = {
            "cast_input_dtype_enabled": sorted({m.cast_input_dtype_enabled for m in layers}),
            "lora_layers": len(layers),
            "dtypes": sorted({str(p.dtype) for n, p in model.named_parameters() if "lora_" in n}),
        }
        (Path(cfg.output_dir) / "fast_path.json").write_text(json.dumps(record))


def test_bf16_adapters_with_masters_and_the_input_cast_off_train_through_the_plugin(workspace):
    config = fora_config(
        workspace,
        "fast",
        plugins=[PLUGIN_NAME, f"{__name__}.FastPathProbePlugin"],
        bf16=True,  # CPU autocast
        fora_adapter_dtype="bfloat16",
        fora_layers=[1, 3],
    )
    axolotl_train(workspace, config)
    out = workspace / "fast"
    record = json.loads((out / "fast_path.json").read_text())
    assert record == {"cast_input_dtype_enabled": [False], "lora_layers": 10, "dtypes": ["torch.bfloat16"]}
    saved = load_file(out / "adapter_model.safetensors")  # plain PEFT LoRA, in the adapters' bf16
    assert adapted_layers(saved) == {1, 3} and {v.dtype for v in saved.values()} == {torch.bfloat16}
    state = torch.load(out / "checkpoint-2" / "optimizer.pt", weights_only=True)["state"]
    assert len(state) == len(saved) == 20
    for entry in state.values():  # lora_A (AdamW) and lora_B (Cayley-Adam) alike
        assert entry["master"].dtype == entry["exp_avg"].dtype == torch.float32
    reloaded = AutoModelForCausalLM.from_pretrained(workspace / "model")
    from peft import PeftModel

    model = PeftModel.from_pretrained(reloaded, out)
    assert all(torch.equal(p.to(torch.bfloat16), saved[k]) for k, p in _lora_state(model).items())


def _lora_state(model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def test_contradicting_adapter_dtypes_are_refused(workspace):
    with pytest.raises(ValidationError, match=r"fora_adapter_dtype='bfloat16' contradicts peft_autocast_adapter"):
        validate(workspace, fora_adapter_dtype="bfloat16", peft_autocast_adapter_dtype=True)
    cfg = validate(workspace, fora_adapter_dtype="bfloat16", fora_input_cast="peft")
    assert (fora_config_from(cfg).adapter_dtype, fora_config_from(cfg).input_cast) == ("bfloat16", "peft")


def test_liger_stops_axolotl_train_in_one_line_before_loading_anything(workspace):
    # No CUDA GPU here: Liger's plugin would stop later, after reading the model's config, with a traceback.
    config = fora_config(
        workspace, "liger", plugins=[PLUGIN_NAME, "axolotl.integrations.liger.LigerPlugin"], liger_rms_norm=True
    )
    output = axolotl_train(workspace, config, "--launcher", "python", check=False)
    line = next(line for line in output.splitlines() if "cannot run here" in line)
    assert line.startswith("liger_rms_norm=True cannot run here: ") and "Set liger_rms_norm to false" in line
    assert "Traceback" not in output and not (workspace / "liger").exists()
