"""The fora command on a tiny local model: YAML in, adapter, scores, plot and table out."""

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from conftest import TARGETS, char_tokenizer, tiny_llama

from fora_plugin import stiefel_parameters
from fora_plugin.cli import main
from fora_plugin.stiefel import orthogonality_error


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model_dir = root / "model"
    tiny_llama(4, vocab_size=99).save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    rows = [
        {"instruction": f"Add {a} and {b}.", "input": "", "output": str(a + b)} for a in range(5) for b in range(5)
    ]
    (root / "data").mkdir()
    (root / "data" / "sums.json").write_text(json.dumps(rows))
    config = {
        "model_name_or_path": str(model_dir),
        "dtype": "float32",
        "dataset_name": "data/sums.json",  # relative to the config file
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_target_modules": TARGETS,
        "fora_fisher_batches": 2,
        "fora_layer_budget": 0.5,
        "output_dir": str(root / "out"),
        "use_cpu": True,
        "bf16": False,
        "activation_checkpointing": False,
        "per_device_train_batch_size": 4,
        "max_steps": 3,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return root, path


def test_fora_train_writes_adapter_scores_and_plot(setup, capsys):
    root, path = setup
    assert main(["train", str(path), "--max_steps", "2"]) == 0  # a command-line override
    out = root / "out"
    saved = json.loads((out / "fora_scores.json").read_text())
    assert saved["k"] == 2 and len(saved["scores"]) == 4 and saved["num_batches"] == 2
    assert (out / "fora_scores.png").exists() and (out / "adapter_model.safetensors").exists()
    printed = capsys.readouterr().out
    assert "| layer | Fisher score | trainable params |" in printed and "adapter (plain PEFT LoRA)" in printed
    state = json.loads((out / "trainer_state.json").read_text()) if (out / "trainer_state.json").exists() else None
    assert state is None or state["global_step"] == 2


def test_fora_score_prints_the_table_for_any_mode(setup, capsys):
    _, path = setup
    assert main(["score", str(path), "--fora_mode", "lora", "--output_dir", str(path.parent / "scored")]) == 0
    printed = capsys.readouterr().out
    assert "LoRA on 2 of 4 decoder layers (chosen by: fisher)" in printed
    assert (path.parent / "scored" / "fora_scores.json").exists()


def test_bad_inputs_give_a_message_not_a_traceback(setup, capsys, tmp_path):
    _, path = setup
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert main(["score", str(path), "--fora_layer_budget", "9"]) == 2
    assert "layer_budget=9 layers is outside 1..4" in capsys.readouterr().err
    assert main(["score", str(path), "--dataset_name", "data/nope.json"]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_version_and_help(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert "fora-plugin" in capsys.readouterr().out
    assert main([]) == 0
    assert "train" in capsys.readouterr().out


def ablation_config(root, path, tmp_path, runs: list[str]):
    """The setup's config with an `ablation:` block over ``runs``, evaluated on a few boolq-style examples."""
    config = yaml.safe_load(path.read_text())
    commonsense = tmp_path / "commonsense" / "boolq"
    commonsense.mkdir(parents=True)
    examples = [
        {
            "instruction": f"Is {a} even?\n\nAnswer format: true/false",
            "input": "",
            "output": f"the correct answer is {str(a % 2 == 0).lower()}",
            "answer": str(a % 2 == 0).lower(),
        }
        for a in range(6)
    ]
    (commonsense / "test.json").write_text(json.dumps(examples))
    config.update(max_steps=1, output_dir=str(tmp_path / "unused"))
    config["ablation"] = {
        "output_dir": str(tmp_path / "grid"),
        "runs": runs,
        "eval": {
            "commonsense_dir": str(tmp_path / "commonsense"),
            "tasks": ["boolq"],
            "max_examples": 4,
            "max_new_tokens": 4,
            "eval_loss_examples": 3,
        },
    }
    grid_config = root / f"grid-{tmp_path.name}.yaml"  # next to data/, which the config names relatively
    grid_config.write_text(yaml.safe_dump(config))
    return grid_config


def test_fora_ablate_trains_evaluates_and_resumes(setup, tmp_path, capsys):
    root, path = setup
    grid_config = ablation_config(root, path, tmp_path, ["lora", "fora", "lora-half-rank"])
    assert main(["ablate", str(grid_config)]) == 0
    table = (tmp_path / "grid" / "ablation.md").read_text()
    for run in ("lora", "fora", "lora-half-rank"):
        assert f"| {run} |" in table
        result = json.loads((tmp_path / "grid" / run / "results.json").read_text())
        assert result["accuracy"]["boolq"]["total"] == 4 and result["eval_loss"] > 0
    fora = json.loads((tmp_path / "grid" / "fora" / "results.json").read_text())
    lora = json.loads((tmp_path / "grid" / "lora" / "results.json").read_text())
    half = json.loads((tmp_path / "grid" / "lora-half-rank" / "results.json").read_text())
    assert fora["trainable_parameters"] * 2 == lora["trainable_parameters"] == half["trainable_parameters"] * 2
    assert len(fora["adapted_layers"]) == 2 and len(lora["adapted_layers"]) == 4
    assert (tmp_path / "grid" / "ablation.png").exists()
    capsys.readouterr()
    assert main(["ablate", str(grid_config)]) == 0  # resumes: nothing is trained again
    assert capsys.readouterr().out.count("finished earlier") == 3


def test_fora_eval_and_report_on_a_trained_adapter(setup, tmp_path, capsys):
    root, path = setup
    assert main(["train", str(path), "--max_steps", "1", "--output_dir", str(tmp_path / "run")]) == 0
    text = tmp_path / "held_out.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 4)
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "--base",
                str(root / "model"),
                "--adapter",
                str(tmp_path / "run"),
                "--wikitext",
                str(text),
                "--ppl-max-length",
                "64",
                "--ppl-stride",
                "32",
                "--output",
                str(tmp_path / "eval"),
            ]
        )
        == 0
    )
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["perplexity"]["perplexity"] > 1
    assert main(["report", str(tmp_path / "run"), "--base", str(root / "model"), "--kl-text", str(text)]) == 0
    printed = capsys.readouterr().out
    assert "| run | q_proj |" in printed and "KL(p_trained" in printed
    assert (tmp_path / "run" / "spectra.png").exists() and (tmp_path / "run" / "fisher_scores.png").exists()
    assert main(["eval", "--base", str(root / "model")]) == 2  # nothing to do: a message, not a traceback


def test_load_in_4bit_in_the_yaml_trains_qfora_on_a_4bit_base(setup):
    # QFoRA from the config: TRL's quantization keys become a BitsAndBytesConfig (NF4, nested quant, the compute
    # dtype from `dtype`), the base loads as Linear4bit, and the adapter goes on the chosen layers only.
    bnb = pytest.importorskip("bitsandbytes")
    from fora_plugin.recipe import build_trainer

    root, path = setup
    overrides = ["--load_in_4bit", "true", "--bnb_4bit_quant_type", "nf4", "--use_bnb_nested_quant", "true"]
    trainer = build_trainer(str(path), [*overrides, "--output_dir", str(root / "qfora")])
    base = trainer.model.get_base_model()
    quantized = [m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 4 * 7  # every linear of the 4 decoder layers
    state = quantized[0].weight.quant_state
    assert state.quant_type == "nf4" and state.nested
    chosen = trainer.fora_selection.chosen
    adapted = {int(n.split(".layers.")[1].split(".")[0]) for n, _ in trainer.model.named_parameters() if "lora_A" in n}
    assert adapted == set(chosen) and len(chosen) == 2
    assert all(score > 0 for score in trainer.fora_selection.scores.scores)
    trainer.train()
    optimizer = trainer.optimizer
    for _, p in stiefel_parameters(trainer.model):
        assert orthogonality_error(optimizer.state[p].get("master", p).float()) < 1e-4


def test_ablation_dora_row_reports_the_effective_rank_of_merged_minus_base(setup, tmp_path):
    # DoRA's ΔW includes its magnitude rescaling: the erank column is of merged − base weights for every run.
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fora_plugin.diagnostics import effective_rank

    root, path = setup
    assert main(["ablate", str(ablation_config(root, path, tmp_path, ["dora"]))]) == 0
    result = json.loads((tmp_path / "grid" / "dora" / "results.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float64)
    base_weights = {n: p.detach().clone() for n, p in base.named_parameters()}
    merged = PeftModel.from_pretrained(base, tmp_path / "grid" / "dora").merge_and_unload()
    ranks = [
        effective_rank(torch.linalg.svdvals(p.detach() - base_weights[n]))
        for n, p in merged.named_parameters()
        if any(f".{t}." in n for t in TARGETS)
    ]
    assert len(ranks) == 4 * len(TARGETS)
    assert result["mean_effective_rank"] == pytest.approx(sum(ranks) / len(ranks), rel=1e-4)


def test_fora_score_scores_afresh_when_the_config_resumes_a_checkpoint(setup, tmp_path, capsys, caplog):
    import logging

    root, path = setup
    checkpoint = tmp_path / "checkpoint-7"
    checkpoint.mkdir()
    saved = {"mode": "fora", "source": "fisher", "num_layers": 4, "k": 2, "chosen_layers": [0, 1]}
    saved.update(scores=[4.0, 3.0, 2.0, 1.0], num_batches=9, fisher_params="layer", seconds=1.0)
    (checkpoint / "fora_scores.json").write_text(json.dumps(saved))
    out = tmp_path / "scored"
    args = ["score", str(path), "--resume_from_checkpoint", str(checkpoint), "--output_dir", str(out)]
    with caplog.at_level(logging.INFO, logger="fora_plugin.recipe"):
        assert main(args) == 0
    assert any("scoring afresh" in r.getMessage() and str(checkpoint) in r.getMessage() for r in caplog.records)
    written = json.loads((out / "fora_scores.json").read_text())
    assert written["source"] == "fisher" and written["num_batches"] == 2  # the config's fora_fisher_batches
    assert written["scores"] != saved["scores"]
    assert "(chosen by: fisher)" in capsys.readouterr().out


def test_train_help_lists_every_fora_key_with_its_help(capsys):
    from fora_plugin.config import FoRAArguments

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # help wraps lines
    for field in dataclasses.fields(FoRAArguments):
        assert f"--{field.name} (default: {field.default})" in text
        assert " ".join(field.metadata["help"].split()) in text
    assert "SFTConfig" in text and "ModelConfig" in text


def test_only_our_own_validation_errors_become_one_line_messages(setup, monkeypatch, capsys):
    import fora_plugin.cli as cli

    _, path = setup
    assert main(["score", str(path), "--fora_fisher_batches", "0"]) == 2  # FoRAConfig's check: a message
    assert "fisher_batches=0" in capsys.readouterr().err

    def library_failure(config, overrides, **kwargs):
        json.loads("{not json")  # a ValueError raised inside the json library

    monkeypatch.setattr(cli, "build_trainer", library_failure)
    with pytest.raises(json.JSONDecodeError):  # keeps its traceback
        main(["score", str(path)])

    def our_bug(config, overrides, **kwargs):
        from fora_plugin.selection import select_layers

        select_layers(["0.5", "0.7"], 1)  # a TypeError inside our code, not one of its checks

    monkeypatch.setattr(cli, "build_trainer", our_bug)
    with pytest.raises(TypeError):  # keeps its traceback
        main(["score", str(path)])


def test_no_import_cycle_between_the_packages_modules():
    # `fora ablate` and `fora train` share the recipe; neither imports the other's command module.
    graph = {}
    import fora_plugin

    package = Path(fora_plugin.__file__).resolve().parent
    for file in package.rglob("*.py"):
        parts = file.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        parent = name if parts[-1] == "__init__" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = parent.split(".")[: len(parent.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                deps.add(target)
        graph[name] = deps - {"fora_plugin"}  # the package itself is imported before any of its modules

    def cycle_from(start, node, seen):
        for dep in graph.get(node, ()):
            if dep == start:
                return [*seen, dep]
            if dep not in seen:
                found = cycle_from(start, dep, [*seen, dep])
                if found:
                    return found
        return None

    cycles = [cycle_from(m, m, [m]) for m in graph if m != "fora_plugin"]
    assert [c for c in cycles if c] == []


def test_third_party_noise_is_silenced_by_its_exact_text_only(caplog):
    import logging
    import warnings

    from peft import LoraConfig, get_peft_model

    from fora_plugin.cli import quiet_third_party_noise

    quiet_third_party_noise()
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "No module")
        bnb.warning("Some other bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == ["Some other bitsandbytes warning"]

    def peft_warnings(quiet: bool) -> list[str]:
        # PEFT reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if quiet:
                quiet_third_party_noise()
            get_peft_model(tiny_llama(2), LoraConfig(r=2, target_modules=TARGETS))
        return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]

    assert any("is_gradient_checkpointing" in m for m in peft_warnings(quiet=False))
    assert peft_warnings(quiet=True) == []


def test_fora_train_prints_no_warning_our_code_or_config_causes(setup, tmp_path):
    # The real command in a fresh process, as a user runs it (the setup's config is shaped like the quickstart's).
    import os
    import subprocess
    import sys

    _, path = setup
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONWARNINGS")}
    command = [sys.executable, "-m", "fora_plugin.cli", "train", str(path), "--max_steps", "1"]
    done = subprocess.run(
        [*command, "--output_dir", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    # What this project's configs and code caused: transformers' and PEFT's deprecations, DeepSpeed's guess.
    for noise in ("FutureWarning", "checkpointing` is deprecated", "Setting accelerator to CPU"):
        assert noise not in output, output
    assert "FoRA training done" in output
