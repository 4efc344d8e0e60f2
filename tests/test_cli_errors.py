"""Every user mistake the `fora` command can meet: exit code 2 and a message naming the bad value, no traceback.

Each row runs `fora_plugin.cli.main([...])` in this process on a tiny local model and dataset. Most rows are refused
before any model is loaded; the few that need a model use the one tiny folder of this module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import TARGETS, char_tokenizer, tiny_llama

from fora_plugin.cli import main


ROWS = [{"instruction": f"Add {a} and {b}.", "input": "", "output": str(a + b)} for a in range(4) for b in range(4)]


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli_errors")
    tiny_llama(2, vocab_size=99).save_pretrained(root / "model")
    char_tokenizer().save_pretrained(root / "model")
    (root / "sums.json").write_text(json.dumps(ROWS))
    return root


@dataclass
class Ctx:
    """What a row builds its command line from: the shared model and data, and a scratch folder of its own."""

    shared: Path
    tmp: Path

    def base(self) -> dict:
        return {
            "model_name_or_path": str(self.shared / "model"),
            "dtype": "float32",
            "dataset_name": str(self.shared / "sums.json"),
            "lora_r": 2,
            "lora_alpha": 4,
            "lora_target_modules": TARGETS,
            "fora_fisher_batches": 1,
            "output_dir": str(self.tmp / "out"),
            "use_cpu": True,
            "bf16": False,
            "activation_checkpointing": False,
            "per_device_train_batch_size": 4,
            "max_steps": 1,
            "save_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
        }

    def config(self, drop: tuple[str, ...] = (), **changes) -> str:
        data = {k: v for k, v in self.base().items() if k not in drop}
        data.update(changes)
        return self.file("config.yaml", yaml.safe_dump(data))

    def file(self, name: str, text: str) -> str:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return str(path)

    def checkpoint(self, chosen: list[int]) -> str:
        """A checkpoint folder holding the FoRA selection a run on layers ``chosen`` saved."""
        folder = self.tmp / "out" / "checkpoint-1"
        folder.mkdir(parents=True)
        selection = {"mode": "fora", "source": "fisher", "num_layers": 2, "k": len(chosen), "chosen_layers": chosen}
        (folder / "fora_scores.json").write_text(json.dumps({**selection, "scores": None}))
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
        return str(folder)

    def adapter(self, poison: bool = False) -> str:
        """A saved PEFT LoRA adapter of the tiny model; ``poison`` puts a NaN into one lora_B."""
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(self.shared / "model"), LoraConfig(r=2, target_modules=TARGETS)
        )
        if poison:
            with torch.no_grad():
                next(p for n, p in model.named_parameters() if "lora_B" in n)[0, 0] = float("nan")
        model.save_pretrained(self.tmp / "adapter")
        return str(self.tmp / "adapter")


def ds_config(ctx: Ctx, stage: int, **extra) -> str:
    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto", **extra}
    return ctx.file(f"zero{stage}.json", json.dumps(config))


def ablation_config(ctx: Ctx, block) -> str:
    return ctx.file("ablate.yaml", yaml.safe_dump({**ctx.base(), **({"ablation": block} if block else {})}))


# (id, command line from a Ctx, a regex the message must match). Rows whose fix another change brings are listed
# with their final behaviour.
CASES: list[tuple[str, Callable[[Ctx], list[str]], str]] = [
    # --- the config file
    ("missing-config", lambda c: ["train", str(c.tmp / "nope.yaml")], r"nope\.yaml'? is not a file"),
    ("config-is-a-folder", lambda c: ["train", str(c.tmp)], r"is not a file"),
    (
        "yaml-syntax-error",
        lambda c: ["train", c.file("broken.yaml", "lora_r: 4\nlora_alpha: [8\nmax_steps: 1\n")],
        r"broken\.yaml is not valid YAML at line \d+",
    ),
    ("yaml-not-a-mapping", lambda c: ["score", c.file("list.yaml", "- a\n- b\n")], r"list\.yaml holds a YAML list"),
    ("unknown-yaml-key", lambda c: ["score", c.config(lerning_rate=0.1)], r"lerning_rate"),
    ("unknown-override", lambda c: ["score", c.config(), "--fora_layer_budgett", "2"], r"fora_layer_budgett"),
    ("no-model", lambda c: ["score", c.config(drop=("model_name_or_path",))], r"no model_name_or_path"),
    ("no-dataset", lambda c: ["score", c.config(drop=("dataset_name",))], r"no dataset_name"),
    # --- fora_* keys
    ("mode", lambda c: ["score", c.config(), "--fora_mode", "foraa"], r"foraa"),
    ("budget-zero", lambda c: ["score", c.config(), "--fora_layer_budget", "0"], r"layer_budget=0"),
    ("budget-fraction", lambda c: ["score", c.config(), "--fora_layer_budget", "1.5"], r"layer_budget=1\.5"),
    ("budget-word", lambda c: ["score", c.config(), "--fora_layer_budget", "half"], r"layer_budget='half'"),
    ("budget-too-many", lambda c: ["score", c.config(), "--fora_layer_budget", "9"], r"layer_budget=9 layers"),
    ("fisher-batches", lambda c: ["score", c.config(), "--fora_fisher_batches", "0"], r"fisher_batches=0"),
    ("qr-period", lambda c: ["score", c.config(), "--fora_qr_period", "-1"], r"qr_period=-1"),
    ("cayley-iters", lambda c: ["score", c.config(), "--fora_cayley_iters", "0"], r"cayley_iters=0"),
    ("lr-stiefel-zero", lambda c: ["score", c.config(), "--fora_lr_stiefel", "0"], r"lr_stiefel=0"),
    ("lr-stiefel-nan", lambda c: ["score", c.config(), "--fora_lr_stiefel", "nan"], r"lr_stiefel=nan"),
    ("lr-stiefel-inf", lambda c: ["score", c.config(), "--fora_lr_stiefel", "inf"], r"lr_stiefel=inf"),
    ("init-a", lambda c: ["score", c.config(), "--fora_init_a", "ones"], r"ones"),
    ("layers-repeat", lambda c: ["train", c.config(fora_layers=[0, 0])], r"layers=\[0, 0\]"),
    ("layers-with-lora-mode", lambda c: ["train", c.config(fora_layers=[0], fora_mode="lora")], r"contradicts"),
    (
        "layers-and-scores-path",
        lambda c: ["train", c.config(fora_layers=[0], fora_scores_path="s.json")],
        r"layers and scores_path",
    ),
    ("layer-out-of-range", lambda c: ["train", c.config(fora_layers=[0, 5])], r"indices \[5\] outside 0\.\.1"),
    ("scores-path-missing", lambda c: ["train", c.config(fora_scores_path=str(c.tmp / "no.json"))], r"no\.json"),
    # --- training keys
    ("learning-rate-nan", lambda c: ["train", c.config(), "--learning_rate", "nan"], r"learning_rate=nan"),
    ("optim", lambda c: ["train", c.config(), "--optim", "sgd"], r"optim='sgd'"),
    # TRL's ModelConfig has no init_lora_weights key (PiSSA & co. are refused by FoRASFTTrainer and the Axolotl args).
    (
        "init-lora-weights-is-no-trl-key",
        lambda c: ["train", c.config(), "--lora_init_lora_weights", "pissa"],
        r"unknown overrides \['--lora_init_lora_weights'\]",
    ),
    ("dora-with-fora", lambda c: ["train", c.config(use_dora=True)], r"use_dora=True"),
    ("all-linear", lambda c: ["train", c.config(lora_target_modules="all-linear")], r"all-linear"),
    (
        "output-dir-is-a-file",
        lambda c: ["train", c.config(output_dir=c.file("taken.txt", "x"))],
        r"output_dir='.*taken\.txt' is a file",
    ),
    (
        "resume-without-checkpoint",
        lambda c: ["train", c.config(), "--resume_from_checkpoint", "true"],
        r"resume_from_checkpoint=True but .* holds no checkpoint",
    ),
    (
        "resume-with-other-layers",
        lambda c: ["train", c.config(fora_layers=[1]), "--resume_from_checkpoint", c.checkpoint([0])],
        r"layers=?\s?\[1\].*\[0\].*checkpoint|checkpoint.*\[0\].*layers=?\s?\[1\]",  # names both layer sets
    ),
    # --- data
    ("dataset-missing", lambda c: ["score", c.config(dataset_name="nope.json")], r"nope\.json"),
    (
        "dataset-malformed",
        lambda c: ["score", c.config(dataset_name=c.file("bad.json", '[{"instruction": "a",\n "output" "b"}]'))],
        r"bad\.json is not valid JSON: .* at line 2",
    ),
    (
        "dataset-malformed-jsonl",
        lambda c: ["score", c.config(dataset_name=c.file("bad.jsonl", '{"text": "a"}\n{"text": b}\n'))],
        r"bad\.jsonl is not valid JSON Lines: .* at line 2",
    ),
    (
        "dataset-wrong-columns",
        lambda c: ["score", c.config(dataset_name=c.file("qa.jsonl", '{"question": "a", "answer": "b"}\n'))],
        r"qa\.jsonl has rows with columns \['answer', 'question'\].*instruction \+ output",
    ),
    ("dataset-not-json", lambda c: ["score", c.config(dataset_name=c.file("rows.csv", "a,b\n"))], r"rows\.csv"),
    (
        "dataset-config-for-a-file",
        lambda c: ["score", c.config(), "--dataset_config", "main"],
        r"config_name='main'",
    ),
    # --- model
    ("model-folder-missing", lambda c: ["score", c.config(model_name_or_path="./no_model")], r"no_model"),
    ("gguf-missing", lambda c: ["score", c.config(model_name_or_path="/x/m.gguf")], r"m\.gguf"),
    # --- DeepSpeed in one process (no launcher): refused before the model loads
    (
        "deepspeed-zero2-one-process",
        lambda c: ["train", c.config(), "--deepspeed", ds_config(c, 2)],
        r"not started by a distributed launcher.*torchrun",
    ),
    (
        "deepspeed-zero3-one-process",
        lambda c: ["train", c.config(), "--deepspeed", ds_config(c, 3)],
        r"ZeRO-3|not started by a distributed launcher",
    ),
    (
        "deepspeed-optimizer-block",
        lambda c: ["train", c.config(), "--deepspeed", ds_config(c, 2, optimizer={"type": "Adam"})],
        r"optimizer` block \('Adam'\)",
    ),
    ("deepspeed-missing", lambda c: ["train", c.config(), "--deepspeed", str(c.tmp / "z.json")], r"z\.json"),
    # --- eval, report, ablate
    ("eval-nothing-to-do", lambda c: ["eval", "--base", str(c.shared / "model")], r"nothing to do"),
    (
        "eval-task-missing",
        lambda c: ["eval", "--base", str(c.shared / "model"), "--commonsense-dir", str(c.tmp), "--tasks", "boolq"],
        r"has no boolq/test\.json",
    ),
    ("report-not-an-adapter", lambda c: ["report", str(c.tmp)], r"is not a PEFT adapter folder"),
    ("report-nan-adapter", lambda c: ["report", c.adapter(poison=True)], r"NaN/inf weights in 1 tensors"),
    ("report-kl-without-base", lambda c: ["report", c.adapter(), "--kl-text", c.file("t.txt", "ab")], r"--base"),
    (
        "eval-malformed-task-file",
        lambda c: [
            "eval",
            "--base",
            str(c.shared / "model"),
            "--commonsense-dir",
            str(Path(c.file("boolq/test.json", '[{"instruction": "x"}\n{"answer": "true"}]')).parents[1]),
            "--tasks",
            "boolq",
        ],
        r"boolq/test\.json is not valid JSON: .* at line 2",
    ),
    (
        "eval-wikitext-missing",
        lambda c: ["eval", "--base", str(c.shared / "model"), "--wikitext", str(c.tmp / "wiki.txt")],
        r"--wikitext .*wiki\.txt is not a file",
    ),
    (
        "eval-mt-bench-malformed",
        lambda c: ["eval", "--base", str(c.shared / "model"), "--mt-bench", c.file("q.jsonl", '{"turns": [}\n')],
        r"q\.jsonl is not valid JSON Lines: .* at line 1",
    ),
    (
        "report-kl-text-missing",
        lambda c: ["report", c.adapter(), "--base", str(c.shared / "model"), "--kl-text", str(c.tmp / "held.txt")],
        r"--kl-text .*held\.txt is not a file",
    ),
    ("ablate-no-block", lambda c: ["ablate", ablation_config(c, None)], r"no `ablation:` block"),
    (
        "ablate-yaml-error",
        lambda c: ["ablate", c.file("grid.yaml", "ablation: {runs: [lora\n")],
        r"grid\.yaml is not valid YAML",
    ),
    ("ablate-unknown-run", lambda c: ["ablate", ablation_config(c, {"runs": ["lora", "qlora2"]})], r"qlora2"),
]


@pytest.mark.parametrize("build, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gives_exit_2_and_a_message(shared, tmp_path, capsys, build, message):
    argv = build(Ctx(shared, tmp_path))
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own refusals (choices) exit with 2 too
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, f"exit code {code} for {argv}; stderr:\n{err}"
    assert "Traceback" not in err
    assert re.search(message, err, flags=re.DOTALL), err
