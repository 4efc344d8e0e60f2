"""The fora command on a tiny local model: YAML in, adapter, scores, plot and table out."""

import json

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
        "gradient_checkpointing": False,
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


def test_fora_ablate_trains_evaluates_and_resumes(setup, tmp_path, capsys):
    root, path = setup
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
        "runs": ["lora", "fora", "lora-half-rank"],
        "eval": {
            "commonsense_dir": str(tmp_path / "commonsense"),
            "tasks": ["boolq"],
            "max_examples": 4,
            "max_new_tokens": 4,
            "eval_loss_examples": 3,
        },
    }
    grid_config = root / "grid.yaml"
    grid_config.write_text(yaml.safe_dump(config))
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
    from fora_plugin.cli import build_trainer

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
