"""Every user mistake the `fora` command can meet: exit code 2 and a message naming the bad value, no traceback.

Each row runs `fora_plugin.cli.main([...])` in this process on a tiny local model and dataset. Most rows are refused
before any model is loaded; the few that need a model use the one tiny folder of this module.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import EXPERT_PARAMETERS, TARGETS, char_tokenizer, tiny_llama, tiny_moe

from fora_plugin.cli import main
from fora_plugin.recipe import parse_config


ROWS = [{"instruction": f"Add {a} and {b}.", "input": "", "output": str(a + b)} for a in range(4) for b in range(4)]
CHAT = [[{"role": "user", "content": f"{a} + {a}?"}, {"role": "assistant", "content": str(2 * a)}] for a in range(8)]
# A chat template that raises on a role it does not know, as many instruct models' templates do.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


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

    def latin1(self, name: str) -> str:
        """A file of Alpaca rows in Latin-1 (é is the byte 0xe9, not UTF-8)."""
        rows = json.dumps([{"instruction": "café", "output": "é"}], ensure_ascii=False)
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rows.encode("latin-1"))
        return str(path)

    def file(self, name: str, text: str) -> str:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return str(path)

    def checkpoint(self, chosen: list[int], rank: int | None = None) -> str:
        """A checkpoint folder holding the FoRA selection a run on layers ``chosen`` saved; with ``rank``, the LoRA
        adapter of that rank it saved too."""
        folder = self.tmp / "out" / "checkpoint-1"
        folder.mkdir(parents=True)
        if rank is not None:
            self.adapter(rank=rank, folder=folder)
        selection = {"mode": "fora", "source": "fisher", "num_layers": 2, "k": len(chosen), "chosen_layers": chosen}
        (folder / "fora_scores.json").write_text(json.dumps({**selection, "scores": None}))
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
        return str(folder)

    def adapter(
        self,
        poison: bool = False,
        config_r: int | None = None,
        selection: list[int] | None = None,
        rank: int = 2,
        folder: Path | None = None,
    ) -> str:
        """A saved PEFT LoRA adapter of the tiny model (r = ``rank``, both layers) in ``folder`` (default: adapter);
        ``poison`` puts a NaN into one lora_B, ``config_r`` writes another r into its adapter_config.json,
        ``selection`` a fora_scores.json choosing those layers."""
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(self.shared / "model"),
            LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS),
        )
        if poison:
            with torch.no_grad():
                next(p for n, p in model.named_parameters() if "lora_B" in n)[0, 0] = float("nan")
        folder = folder or self.tmp / "adapter"
        model.save_pretrained(folder)
        if config_r is not None:
            config = json.loads((folder / "adapter_config.json").read_text())
            (folder / "adapter_config.json").write_text(json.dumps({**config, "r": config_r}))
        if selection is not None:
            chosen = {"mode": "fora", "source": "fisher", "num_layers": 2, "k": len(selection), "scores": None}
            (folder / "fora_scores.json").write_text(json.dumps({**chosen, "chosen_layers": selection}))
        return str(folder)

    def model_folder(self, config: bool = True) -> str:
        """A model folder with (or without) the tiny model's config.json and its tokenizer, but no weights."""
        folder = self.tmp / "half_model"
        char_tokenizer().save_pretrained(folder)
        if config:
            (folder / "config.json").write_text((self.shared / "model" / "config.json").read_text())
        return str(folder)

    def model_copy(self, config_text: str | None = None, drop: str | None = None, latin1: bool = False) -> str:
        """A copy of the tiny model (weights, tokenizer) whose config.json is ``config_text``, lacks the key ``drop``,
        or is in Latin-1 (an é in a value)."""
        import shutil

        folder = self.tmp / "copied_model"
        shutil.copytree(self.shared / "model", folder)
        config = json.loads((folder / "config.json").read_text())
        if drop is not None:
            config.pop(drop)
        text = config_text if config_text is not None else json.dumps(config, indent=2)
        if latin1:
            (folder / "config.json").write_bytes(text.replace('"llama"', '"llama", "note": "café"').encode("latin-1"))
        else:
            (folder / "config.json").write_text(text)
        return str(folder)

    def model_variant(self, tokenizer: bool = True, chat_template: str | None = None, weights: str = "whole") -> str:
        """A copy of the tiny model without its tokenizer files, with ``chat_template`` in its tokenizer, or with its
        ``weights`` "sharded" (an index naming two shards, the second missing) or "truncated"."""
        folder = Path(self.model_copy())
        if not tokenizer:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                (folder / name).unlink()
        if chat_template is not None:
            config = json.loads((folder / "tokenizer_config.json").read_text())
            (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template}))
        weights_file = folder / "model.safetensors"
        if weights == "truncated":
            weights_file.write_bytes(weights_file.read_bytes()[:-100])
        if weights == "sharded":
            from safetensors import safe_open

            with safe_open(str(weights_file), "pt") as tensors:
                names = list(tensors.keys())
            shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
            weights_file.rename(folder / shards[0])
            weight_map = {n: shards[i >= len(names) // 2] for i, n in enumerate(names)}
            (folder / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map})
            )
        return str(folder)

    def save_to_disk(self) -> str:
        """The Alpaca rows saved as a `datasets` folder (Dataset.save_to_disk)."""
        from datasets import Dataset

        Dataset.from_list(ROWS).save_to_disk(str(self.tmp / "saved_rows"))
        return str(self.tmp / "saved_rows")

    def moe_folder(self, weights: bool = False, experts: int = 2) -> str:
        """A 2-layer, 2-expert Qwen3-MoE (experts fused: gate_up_proj, down_proj): its config.json (what `fora plan`
        reads), with ``weights`` its weights and the tokenizer too; ``experts``: its config's num_experts (0: a
        config whose every MLP is dense)."""
        folder = self.tmp / "moe"
        model = tiny_moe(num_layers=2, num_experts=2, vocab_size=99)
        model.config.num_experts = experts
        if weights:
            model.save_pretrained(folder)
            char_tokenizer().save_pretrained(folder)
        else:
            model.config.save_pretrained(folder)
        return str(folder)

    def read_only_output(self) -> str:
        """An output_dir under a folder nobody can write to (chmod for a user; /proc's root for root)."""
        if os.geteuid() == 0:
            return "/proc/fora-read-only/out"
        folder = self.tmp / "locked"
        folder.mkdir()
        folder.chmod(0o555)
        return str(folder / "out")

    def eval(self, *flags: str) -> list[str]:
        """`fora eval` on the tiny model with one commonsense task, plus ``flags``."""
        task = Path(self.file("tasks/boolq/test.json", json.dumps([{"instruction": "x", "answer": "true"}])))
        base = ["eval", "--base", str(self.shared / "model"), "--commonsense-dir", str(task.parents[1])]
        return [*base, "--tasks", "boolq", *flags]

    def earlier_eval(self, name: str) -> str:
        """A folder holding what an earlier `fora eval` wrote (results.json, results.md)."""
        self.file(f"{name}/results.md", "| earlier |")
        return str(Path(self.file(f"{name}/results.json", EARLIER_EVAL)).parent)

    def perplexity(self, *flags: str) -> list[str]:
        """`fora eval` on the tiny model with a two-character WikiText file, plus ``flags``."""
        return ["eval", "--base", str(self.shared / "model"), "--wikitext", self.file("w.txt", "ab"), *flags]


def earlier_run(folder: Path) -> None:
    """What an earlier, finished run left in ``folder``: every row's output folder starts with these files."""
    folder.mkdir(parents=True, exist_ok=True)
    selection = {"mode": "fora", "source": "fisher", "num_layers": 2, "k": 1, "chosen_layers": [1], "scores": [1, 2]}
    (folder / "fora_scores.json").write_text(json.dumps(selection))
    (folder / "fora_scores.png").write_bytes(b"\x89PNG earlier plot")
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    (folder / "adapter_model.safetensors").write_bytes(b"earlier weights")
    (folder / "results.json").write_text("{}")


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


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
    (
        "cuda-graph-without-a-gpu",
        lambda c: ["train", c.config(), "--fora_cuda_graph", "true"],
        r"cuda_graph=True cannot be used here: this run has no CUDA GPU",
    ),
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
    # ---------------------------------------------------------------- PEFT's errors, each as one line
    # what PEFT would otherwise report with a traceback
    (
        "target-module-absent",
        lambda c: ["train", c.config(lora_target_modules=["q_proj", "qkv_proj"])],
        r"lora_target_modules=\['q_proj', 'qkv_proj'\] is invalid: the model has no module named \['qkv_proj'\] "
        r"\(its linear modules are \['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', "
        r"'v_proj'\]\)\. Use some of those, e\.g\. lora_target_modules: \[down_proj, gate_proj, k_proj, o_proj, "
        r"q_proj, up_proj, v_proj\]\. For 'qkv_proj', did you mean v_proj\?",
    ),
    ("lora-r-zero", lambda c: ["train", c.config(), "--lora_r", "0"], r"lora_r=0 is invalid: use an int >= 1"),
    ("lora-r-negative", lambda c: ["score", c.config(lora_r=-4)], r"lora_r=-4 is invalid"),
    (
        "target-modules-one-string-cli",
        lambda c: ["train", c.config(drop=("lora_target_modules",)), "--lora_target_modules", "q_proj,v_proj"],
        r"lora_target_modules='q_proj,v_proj' is invalid: .*one name holding several.*\[q_proj, v_proj\]",
    ),
    (
        "target-modules-one-string-yaml",
        lambda c: ["train", c.config(lora_target_modules="q_proj, v_proj")],
        r"lora_target_modules='q_proj, v_proj' is invalid: .*`lora_target_modules: \[q_proj, v_proj\]`",
    ),
    # silent or empty results
    (
        "resume-from-adapter-folder",
        lambda c: ["train", c.config(), "--resume_from_checkpoint", c.adapter()],
        r"resume_from_checkpoint='.*adapter' is invalid: it is a saved adapter, not a checkpoint: it has no "
        r"trainer_state\.json",
    ),
    (
        "resume-folder-missing",
        lambda c: ["train", c.config(), "--resume_from_checkpoint", str(c.tmp / "out" / "checkpoint-9")],
        r"resume_from_checkpoint='.*checkpoint-9' is invalid: no such folder",
    ),
    ("lora-alpha-zero", lambda c: ["train", c.config(lora_alpha=0)], r"lora_alpha=0 is invalid: .*does nothing"),
    ("lora-alpha-negative", lambda c: ["train", c.config(), "--lora_alpha", "-8"], r"lora_alpha=-8 is invalid"),
    ("eval-max-examples-negative", lambda c: c.eval("--max-examples", "-5"), r"--max-examples=-5 is invalid"),
    ("eval-max-examples-zero", lambda c: c.eval("--max-examples", "0"), r"--max-examples=0 is invalid"),
    (
        "report-config-rank-mismatch",
        lambda c: ["report", c.adapter(config_r=8)],
        r"adapter adapter_config\.json r=8 is invalid: the weights of 10 modules have another rank .*rank 2, the "
        r"config says 8",
    ),
    (
        "eval-adapter-rank-mismatch",
        lambda c: c.eval("--adapter", c.adapter(config_r=8)),
        r"--adapter adapter_config\.json r=8 is invalid",
    ),
    (
        "dataset-all-completions-empty",
        lambda c: [
            "train",
            c.config(dataset_name=c.file("blank.json", json.dumps([{**r, "output": ""} for r in ROWS]))),
        ],
        r"dataset_name='.*blank\.json' is invalid: all 16 rows have an empty 'completion'",
    ),
    (
        "dataset-all-completions-blank-jsonl",
        lambda c: [
            "score",
            c.config(dataset_name=c.file("pc.jsonl", '{"prompt": "a", "completion": " "}\n' * 3)),
        ],
        r"pc\.jsonl' is invalid: all 3 rows have an empty 'completion'",
    ),
    (
        "yaml-duplicate-key",
        lambda c: ["train", c.file("twice.yaml", Path(c.config()).read_text() + "lora_r: 4\n")],
        r"twice\.yaml sets 'lora_r' twice, on lines \d+ and \d+",
    ),
    ("ablate-runs-empty-list", lambda c: ["ablate", ablation_config(c, {"runs": []})], r"ablation\.runs=\[\]"),
    (
        "ablate-runs-left-empty",
        lambda c: [
            "ablate",
            c.file("grid.yaml", Path(ablation_config(c, {"runs": ["lora"]})).read_text().replace("- lora", "")),
        ],
        r"ablation\.runs=None is invalid: give a non-empty list of runs",
    ),
    # tracebacks that are now messages
    (
        "output-dir-read-only",
        lambda c: ["train", c.config(output_dir=c.read_only_output())],
        r"output_dir='.*out' is invalid: .* is not writable",
    ),
    (
        "model-folder-without-weights",
        lambda c: ["train", c.config(model_name_or_path=c.model_folder())],
        r"model_name_or_path='.*half_model' is invalid: the folder has config\.json but no weights",
    ),
    (
        "model-folder-without-config",
        lambda c: ["score", c.config(model_name_or_path=c.model_folder(config=False))],
        r"model_name_or_path='.*half_model' is invalid: the folder has no config\.json",
    ),
    (
        "dataset-not-utf8",
        lambda c: ["train", c.config(dataset_name=c.latin1("latin.json"))],
        r"dataset_name='.*latin\.json' is invalid: the file is not UTF-8 text \(byte 0xe9 on line 1",
    ),
    (
        "dataset-empty-list",
        lambda c: ["train", c.config(dataset_name=c.file("none.json", "[]"))],
        r"dataset_name='.*none\.json' is invalid: the file holds '\[\]', no rows",
    ),
    (
        "dataset-name-unreachable",
        lambda c: ["score", c.config(dataset_name="no-such-org/no-such-data")],
        r"dataset_name='no-such-org/no-such-data' is neither a local file or folder nor a dataset the hub could give",
    ),
    # unclear messages
    (
        "mode-one-line-labelled",
        lambda c: ["train", c.config(), "--fora_mode", "foraa"],
        # a value of the command line is named as such, not blamed on the config file
        r"^fora train: error: --fora_mode on the command line: invalid choice: 'foraa' \(choose from 'fora', ",
    ),
    (
        "unknown-yaml-key-suggests-the-key",
        lambda c: ["train", c.config(lerning_rate=0.1)],
        r"unknown keys \['lerning_rate'\].*did you mean learning_rate\?",
    ),
    (
        "unknown-override-without-the-list",
        lambda c: ["train", c.config(), "--learning_rate", "1e-4", "--fora_layer_budgett", "2"],
        r"^(?!.*learning_rate).*unknown overrides \['--fora_layer_budgett'\].*did you mean --fora_layer_budget\?$",
    ),
    (
        "scores-path-other-layer-count",
        lambda c: ["train", c.config(fora_scores_path=c.file("s8.json", json.dumps({"scores": [1.0] * 8})))],
        r"holds scores for 8 layers, but this model has 2 decoder layers",
    ),
    # out-of-range sizes and probabilities (training)
    ("lora-dropout-one", lambda c: ["train", c.config(lora_dropout=1.0)], r"lora_dropout=1\.0 is invalid"),
    ("batch-size-zero", lambda c: ["train", c.config(per_device_train_batch_size=0)], r"batch_size=0 is invalid"),
    (
        "grad-accumulation-zero",
        lambda c: ["train", c.config(), "--gradient_accumulation_steps", "0"],
        r"gradient_accumulation_steps=0 is invalid",
    ),
    ("max-steps-zero", lambda c: ["train", c.config(max_steps=0)], r"max_steps=0 is invalid"),
    (
        "epochs-zero",
        lambda c: ["train", c.config(max_steps=-1, num_train_epochs=0)],
        r"num_train_epochs=0 is invalid",
    ),
    ("max-length-zero", lambda c: ["train", c.config(max_length=0)], r"max_length=0 is invalid"),
    ("weight-decay-negative", lambda c: ["train", c.config(weight_decay=-0.1)], r"weight_decay=-0\.1 is invalid"),
    ("max-grad-norm-nan", lambda c: ["train", c.config(), "--max_grad_norm", "nan"], r"max_grad_norm=nan is invalid"),
    ("adam-beta1-one", lambda c: ["train", c.config(adam_beta1=1.0)], r"adam_beta1=1\.0 is invalid"),
    ("adam-beta2-negative", lambda c: ["train", c.config(adam_beta2=-0.5)], r"adam_beta2=-0\.5 is invalid"),
    ("adam-epsilon-negative", lambda c: ["train", c.config(adam_epsilon=-1e-8)], r"adam_epsilon=-1e-08 is invalid"),
    ("warmup-steps-negative", lambda c: ["train", c.config(warmup_steps=-3)], r"warmup_steps=-3 is invalid"),
    (
        "label-smoothing-over-one",
        lambda c: ["train", c.config(label_smoothing_factor=1.5)],
        r"label_smoothing_factor=1\.5 is invalid",
    ),
    ("logging-steps-zero", lambda c: ["train", c.config(logging_steps=0)], r"logging_steps=0 is invalid"),
    ("seed-negative", lambda c: ["train", c.config(seed=-1)], r"seed=-1 is invalid"),
    ("workers-negative", lambda c: ["train", c.config(dataloader_num_workers=-1)], r"num_workers=-1 is invalid"),
    # out-of-range sizes (evaluation), and eval/report/ablate paths
    ("eval-batch-size-zero", lambda c: c.eval("--batch-size", "0"), r"--batch-size=0 is invalid"),
    ("eval-max-new-tokens-zero", lambda c: c.eval("--max-new-tokens", "0"), r"--max-new-tokens=0 is invalid"),
    (
        "eval-ppl-stride-zero",
        lambda c: c.perplexity("--ppl-stride", "0"),
        r"--ppl-stride=0 is invalid",
    ),
    (
        "eval-ppl-stride-over-window",
        lambda c: c.perplexity("--ppl-max-length", "16", "--ppl-stride", "32"),
        r"--ppl-stride=32 is invalid: the stride must be at most --ppl-max-length \(16\)",
    ),
    (
        "eval-ppl-max-tokens-zero",
        lambda c: c.perplexity("--ppl-max-tokens", "0"),
        r"--ppl-max-tokens=0 is invalid",
    ),
    (
        "eval-output-is-a-file",
        lambda c: c.eval("--output", c.file("res.txt", "x")),
        r"--output='.*res\.txt' is a file",
    ),
    (
        "eval-base-without-weights",
        lambda c: ["eval", "--base", c.model_folder(), "--wikitext", c.file("w.txt", "ab")],
        r"--base='.*half_model' is invalid: the folder has config\.json but no weights",
    ),
    (
        "eval-tasks-empty",
        lambda c: c.eval("--tasks", ","),
        r"--tasks=',' is invalid: name at least one task",
    ),
    (
        "eval-wikitext-not-utf8",
        lambda c: ["eval", "--base", str(c.shared / "model"), "--wikitext", c.latin1("w.txt")],
        r"--wikitext='.*w\.txt' is invalid: the file is not UTF-8",
    ),
    ("report-kl-max-tokens-zero", lambda c: ["report", c.adapter(), "--kl-max-tokens", "0"], r"--kl-max-tokens=0"),
    (
        "report-output-is-a-file",
        lambda c: ["report", c.adapter(), "--output", c.file("r.txt", "x")],
        r"--output='.*r\.txt' is a file",
    ),
    (
        "report-selection-disagrees-with-adapter",
        lambda c: ["report", c.adapter(selection=[1])],
        r"fora_scores\.json says layers \[1\] were chosen, but the adapter in .* is on layers \[0, 1\]",
    ),
    (
        "ablate-eval-batch-size-zero",
        lambda c: ["ablate", ablation_config(c, {"runs": ["lora"], "eval": {"batch_size": 0}})],
        r"ablation\.eval\.batch_size=0 is invalid",
    ),
    (
        "ablate-eval-max-examples-negative",
        lambda c: ["ablate", ablation_config(c, {"runs": ["lora"], "eval": {"max_examples": -5}})],
        r"ablation\.eval\.max_examples=-5 is invalid",
    ),
    (
        "eval-base-unreachable",
        lambda c: ["eval", "--base", "no-such-org/no-such-model", "--wikitext", c.file("w.txt", "ab")],
        r"--base 'no-such-org/no-such-model' could not be loaded",
    ),
    (
        "eval-adapter-not-an-adapter",
        lambda c: c.eval("--adapter", str(c.tmp / "tasks")),
        r"--adapter='.*tasks' is invalid: it is not a PEFT adapter folder",
    ),
    (
        "ablate-training-key-out-of-range",
        lambda c: ["ablate", ablation_config(c, {"runs": ["lora"]}), "--lora_dropout", "1.5"],
        r"lora_dropout=1\.5 is invalid",
    ),
    (
        "ablate-unknown-training-key",
        lambda c: ["ablate", c.file("grid.yaml", yaml.safe_dump({**c.base(), "lora_rank": 4, "ablation": {}}))],
        r"config .*grid\.yaml has unknown keys \['lora_rank'\]",
    ),
    (
        "ablate-output-dir-is-a-file",
        lambda c: ["ablate", ablation_config(c, {"runs": ["lora"], "output_dir": c.file("grid.txt", "x")})],
        r"ablation\.output_dir='.*grid\.txt' is a file",
    ),
    # ---------------------------------------------------------------- library errors, each as one line
    # what a library would otherwise report with a traceback
    (
        "target-module-one-name-cli",
        lambda c: ["train", c.config(drop=("lora_target_modules",)), "--lora_target_modules", "foo_proj"],
        r"lora_target_modules=\['foo_proj'\] is invalid: the model has no module named \['foo_proj'\] .* For "
        r"'foo_proj', did you mean o_proj\?",
    ),
    (
        "target-module-one-name-yaml-list",  # TRL's ModelConfig turns a one-item list into a string
        lambda c: ["score", c.config(lora_target_modules=["foo_proj"])],
        r"lora_target_modules=\['foo_proj'\] is invalid: the model has no module named \['foo_proj'\]",
    ),
    (
        "model-config-corrupt-json",
        lambda c: ["train", c.config(model_name_or_path=c.model_copy('{"model_type": "llama",\n "hidden_size" 32}'))],
        r"model_name_or_path config\.json .*copied_model/config\.json is not valid JSON: Expecting ':' delimiter at "
        r"line 2, column 16\. Fix the file there\.$",
    ),
    (
        "plan-model-config-corrupt-json",
        lambda c: ["plan", c.config(model_name_or_path=c.model_copy('{"model_type": "llama",\n "hidden_size" 32}'))],
        r"model_name_or_path config\.json .*config\.json is not valid JSON: Expecting ':' delimiter at line 2",
    ),
    (
        "eval-base-config-not-utf8",
        lambda c: ["eval", "--base", c.model_copy(latin1=True), "--wikitext", c.file("w.txt", "ab")],
        r"--base config\.json='.*config\.json' is invalid: the file is not UTF-8 text \(byte 0xe9 on line \d+",
    ),
    (
        "eval-mt-bench-not-utf8",
        lambda c: ["eval", "--base", str(c.shared / "model"), "--mt-bench", c.latin1("q.jsonl")],
        r"q\.jsonl: the file is not UTF-8 text \(byte 0xe9 on line 1 is not valid UTF-8\)\. Save it as UTF-8",
    ),
    (
        "eval-mt-bench-chat-template-not-utf8",
        lambda c: ["eval", "--base", str(c.shared / "model"), "--mt-bench", "--mt-bench-chat-template", c.latin1("t")],
        r"--mt-bench-chat-template='.*t' is invalid: the file is not UTF-8 text \(byte 0xe9 on line 1",
    ),
    (
        "eval-task-file-not-utf8",
        lambda c: [
            "eval",
            "--base",
            str(c.shared / "model"),
            "--commonsense-dir",
            str(Path(c.latin1("boolq/test.json")).parents[1]),
            "--tasks",
            "boolq",
        ],
        r"boolq/test\.json: the file is not UTF-8 text \(byte 0xe9 on line 1",
    ),
    (
        "dataset-every-row-longer-than-max-length",
        lambda c: ["train", c.config(max_length=8)],
        r"max_length=8 is invalid: every one of the 16 rows of .*sums\.json has a prompt of at least 8 tokens "
        r"\(prompts are \d+ to \d+ tokens, whole rows \d+ to \d+\), so .* TRL drops every row\. Raise max_length "
        r"above the prompts: max_length: \d+ keeps every row whole",
    ),
    (
        "plan-fused-moe-up-without-gate",
        lambda c: ["plan", c.config(model_name_or_path=c.moe_folder())],
        r"lora_target_modules=\['q_proj', 'k_proj', 'v_proj', 'up_proj', 'down_proj'\] is invalid: this model's MoE "
        r"experts are fused: gate_proj and up_proj are one parameter, gate_up_proj, so up_proj cannot be adapted "
        r"without gate_proj\. Target the fused experts with lora_target_parameters: \[mlp\.experts\.down_proj, "
        r"mlp\.experts\.gate_up_proj\] and lora_target_modules: \[q_proj, k_proj, v_proj\], or add gate_proj",
    ),
    (
        "train-fused-moe-up-without-gate",
        lambda c: ["train", c.config(model_name_or_path=c.moe_folder(weights=True))],
        r"lora_target_modules=\[.*'up_proj'.*\] is invalid: this model's MoE experts are fused: .*target_parameters",
    ),
    # silent
    (
        "plan-config-without-hidden-size",
        lambda c: ["plan", c.config(model_name_or_path=c.model_copy(drop="hidden_size"))],
        r"model_name_or_path config\.json='.*config\.json' is invalid: it has no 'hidden_size', which a 'llama' model "
        r"needs: transformers would silently use its default \(4096\)",
    ),
    (
        "train-config-without-num-layers",
        lambda c: ["train", c.config(model_name_or_path=c.model_copy(drop="num_hidden_layers"))],
        r"it has no 'num_hidden_layers', which a 'llama' model needs",
    ),
    (
        "ablate-duplicate-runs",
        lambda c: ["ablate", ablation_config(c, {"runs": ["lora", "lora"]})],
        r"ablation\.runs=\['lora', 'lora'\] is invalid: 'lora' is listed 2 times: each run trains once",
    ),
    (
        "score-with-scores-path",
        lambda c: ["score", c.config(), "--fora_scores_path", c.file("s.json", json.dumps({"scores": [1.0, 2.0]}))],
        r"fora_scores_path='.*s\.json' is invalid: `fora score` always scores every layer afresh",
    ),
    (
        "score-with-layers",
        lambda c: ["score", c.config(fora_layers=[0])],
        r"fora_layers=\[0\] is invalid: `fora score` always scores every layer afresh",
    ),
    (
        "fp16-on-the-cpu",
        lambda c: ["train", c.config(), "--fp16", "true"],
        r"fp16=True is invalid: on the CPU \(use_cpu: true\) fp16 mixed precision is not applied: the run would train "
        r"in float32\. Set fp16: false",
    ),
    # late or unclear
    (
        "eval-wikitext-blank",
        lambda c: ["eval", "--base", str(c.shared / "model"), "--wikitext", c.file("blank.txt", " \n\n")],
        r"--wikitext='.*blank\.txt' is invalid: the file is empty \(or holds only whitespace\)",
    ),
    (
        "report-kl-text-blank",
        lambda c: ["report", c.adapter(), "--base", str(c.shared / "model"), "--kl-text", c.file("held.txt", "\n")],
        r"--kl-text='.*held\.txt' is invalid: the file is empty",
    ),
    (
        "ablate-kl-text-blank",
        lambda c: ["ablate", ablation_config(c, {"runs": ["lora"], "eval": {"kl_text": c.file("kl.txt", "")}})],
        r"ablation\.eval\.kl_text='.*kl\.txt' is invalid: the file is empty",
    ),
    (
        "ablate-kl-text-missing",
        lambda c: ["ablate", ablation_config(c, {"runs": ["lora"], "eval": {"kl_text": str(c.tmp / "no.txt")}})],
        r"ablation\.eval\.kl_text='.*no\.txt' is invalid: it is not a file",
    ),
    (
        "eval-mt-bench-compare-without-answers",
        lambda c: c.eval("--mt-bench", "--judge-model", "judge", "--mt-bench-compare", "nobody"),
        r"--mt-bench-compare='nobody' is invalid: there are no MT-Bench answers of model_id 'nobody' at "
        r"outputs/eval/model_answer/nobody\.jsonl",
    ),
    # smaller
    (
        "json-unterminated-string",
        lambda c: ["score", c.config(dataset_name=c.file("cut.json", '[{"instruction": "a", "output": "b}]'))],
        r"^(?!.*at at).*cut\.json is not valid JSON: Unterminated string starting at line 1, column 33\. Fix",
    ),
    (
        "cli-value-named-as-the-command-line",
        lambda c: ["train", c.config(), "--learning_rate", "abc"],
        r"^fora train: error: --learning_rate on the command line: invalid float value: 'abc'",
    ),
    (
        "cli-library-check-named-as-the-command-line",
        lambda c: ["train", c.config(), "--tf32", "true"],
        r"^fora train: error: --tf32 on the command line: ",
    ),
    (
        "yaml-value-named-in-the-config",
        lambda c: ["train", c.config(learning_rate="abc")],
        r"^fora train: error: config .*config\.yaml: learning_rate: invalid float value: 'abc'",
    ),
    # more of the same classes
    (
        "lora-dropout-with-target-parameters",
        lambda c: ["train", c.config(lora_target_parameters=["mlp.experts.gate_up_proj"])],
        r"lora_dropout=0\.05 is invalid: LoRA on lora_target_parameters \(fused MoE experts\) takes no dropout",
    ),
    (
        "deepspeed-malformed-json",
        lambda c: ["train", c.config(), "--deepspeed", c.file("ds.json", '{"zero_optimization": {"stage": 2,}}')],
        r"--deepspeed on the command line .*ds\.json is not valid JSON: Expecting property name enclosed in double "
        r"quotes at line 1, column 35",
    ),
    (
        "plan-deepspeed-malformed-json",
        lambda c: ["plan", c.config(), "--deepspeed", c.file("ds.json", '{"zero_optimization": {"stage": 2,}}')],
        r"deepspeed .*ds\.json is not valid JSON: Expecting property name enclosed in double quotes at line 1, "
        r"column 35",
    ),
    (
        "scores-path-malformed",
        lambda c: ["train", c.config(fora_scores_path=c.file("s.json", '{"scores": [1, 2}'))],
        r"fora_scores_path .*s\.json is not valid JSON: .* at line 1",
    ),
    # ---------------------------------------------------------------- a library's error of any type, as one line
    # tracebacks: a library's error for what the user gave, whatever its type, is one line where the input is named
    (
        "model-folder-without-tokenizer",  # transformers 5 raises ValueError here, not OSError
        lambda c: ["train", c.config(model_name_or_path=c.model_variant(tokenizer=False))],
        r"model_name_or_path '.*copied_model' could not be loaded: transformers cannot load its tokenizer "
        r"\(ValueError: Couldn't instantiate the backend tokenizer",
    ),
    (
        "model-index-names-a-missing-shard",
        lambda c: ["train", c.config(model_name_or_path=c.model_variant(weights="sharded"))],
        r"model_name_or_path='.*copied_model' is invalid: its model\.safetensors\.index\.json names 2 weight files, "
        r"and 1 of them are not in the folder \(model-00002-of-00002\.safetensors\): an interrupted download",
    ),
    (
        "model-weights-truncated",
        lambda c: ["score", c.config(model_name_or_path=c.model_variant(weights="truncated"))],
        r"model_name_or_path='.*copied_model' is invalid: its weights file model\.safetensors cannot be read "
        r"\(.*\): a truncated or damaged file",
    ),
    (
        "eval-base-of-an-unknown-model-type",  # `fora train` refused it; `fora eval` loads through the same path now
        lambda c: [
            "eval",
            "--base",
            c.model_copy((c.shared / "model" / "config.json").read_text().replace('"llama"', '"llamalike"')),
            "--wikitext",
            c.file("w.txt", "ab"),
        ],
        r"--base='.*copied_model' is invalid: transformers cannot read its config\.json \(.*model type `llamalike`",
    ),
    (
        "report-kl-base-of-an-unknown-model-type",
        lambda c: [
            "report",
            c.adapter(),
            "--base",
            c.model_copy((c.shared / "model" / "config.json").read_text().replace('"llama"', '"llamalike"')),
            "--kl-text",
            c.file("held.txt", "abc"),
        ],
        r"--base='.*copied_model' is invalid: transformers cannot read its config\.json",
    ),
    (
        "dataset-sharegpt-roles-against-the-chat-template",
        lambda c: [
            "train",
            c.config(
                model_name_or_path=c.model_variant(chat_template=STRICT_TEMPLATE),
                dataset_name=c.file(
                    "sharegpt.json",
                    json.dumps(
                        [
                            {"messages": [{**m, "role": {"user": "human"}.get(m["role"], "gpt")} for m in t]}
                            for t in CHAT
                        ]
                    ),
                ),
            ),
        ],
        r"dataset_name='.*sharegpt\.json' is invalid: row 0's conversation \(roles \['human', 'gpt'\]\) cannot be "
        r"rendered by the chat template of model_name_or_path .* \(TemplateError: Unknown role: human\)\. ShareGPT's "
        r"roles: rename human -> user and gpt -> assistant",
    ),
    (
        "dataset-messages-without-a-chat-template",
        lambda c: ["train", c.config(dataset_name=c.file("chat.json", json.dumps([{"messages": t} for t in CHAT])))],
        r"dataset_name='.*chat\.json' is invalid: its rows are conversations \('messages'\), but the tokenizer of "
        r"model_name_or_path .* has no chat template for them\. Set chat_template_path",
    ),
    (
        "model-chat-template-does-not-compile",
        lambda c: ["train", c.config(model_name_or_path=c.model_variant(chat_template="{% for m in messages %}x"))],
        r"the chat template of model_name_or_path '.*copied_model' is not a valid Jinja template: Unexpected end of "
        r"template.*\(line 1\)",
    ),
    (
        "chat-template-path-does-not-compile",
        lambda c: [
            "train",
            c.config(
                dataset_name=c.file("chat.json", json.dumps([{"messages": t} for t in CHAT])),
                chat_template_path=c.file("chat.jinja", "{% if messages %}{{ messages }}"),
            ),
        ],
        r"chat_template_path .*chat\.jinja is not a valid Jinja template: .*\(line 1\)\. Fix the template there",
    ),
    (
        "chat-template-path-a-missing-jinja-file",  # a typo: refused, not handed to TRL as a tokenizer name
        lambda c: [
            "train",
            c.config(
                dataset_name=c.file("chat.json", json.dumps([{"messages": t} for t in CHAT])),
                chat_template_path=str(c.tmp / "chta.jinja"),
            ),
        ],
        r"chat_template_path='.*chta\.jinja' is invalid",
    ),
    (
        "dataset-messages-as-strings",
        lambda c: [
            "train",
            c.config(
                dataset_name=c.file(
                    "m.json", json.dumps([{"messages": f"user: {a}? assistant: {a}"} for a in range(4)])
                )
            ),
        ],
        r"dataset_name='.*m\.json' is invalid: its column 'messages' holds Value\('string'\) \(row 0: 'user: 0\? "
        r"assistant: 0'\), not a list of \{\"role\": \.\.\., \"content\": \.\.\.\} messages per row",
    ),
    (
        "dataset-output-numbers",
        lambda c: ["train", c.config(dataset_name=c.file("n.json", json.dumps([{**r, "output": 7} for r in ROWS])))],
        r"dataset_name='.*n\.json' is invalid: its column 'output' holds Value\('int64'\) .* not a string per row",
    ),
    (
        "resume-at-another-rank",
        lambda c: ["train", c.config(), "--resume_from_checkpoint", c.checkpoint([0, 1], rank=4)],
        r"lora_r=2 is invalid: checkpoint .*checkpoint-1 was trained with lora_r 4 \(its adapter_config\.json\), and "
        r"a resumed run keeps its adapter\. Set lora_r: 4 to resume it, or drop resume_from_checkpoint",
    ),
    (
        "resume-with-other-targets",
        lambda c: [
            "train",
            c.config(lora_target_modules=["q_proj", "v_proj"]),
            "--resume_from_checkpoint",
            c.checkpoint([0, 1], rank=2),
        ],
        r"lora_target_modules=\['q_proj', 'v_proj'\] is invalid: checkpoint .* was trained with lora_target_modules "
        r"\['down_proj', 'k_proj', 'q_proj', 'up_proj', 'v_proj'\]",
    ),
    (
        "eval-mt-bench-chat-template-unclosed",
        lambda c: [
            "eval",
            "--base",
            str(c.shared / "model"),
            "--mt-bench",
            "--mt-bench-chat-template",
            c.file("tpl.jinja", "{% for m in messages %}{{ m['content'] }}"),
        ],
        r"--mt-bench-chat-template .*tpl\.jinja is not a valid Jinja template: Unexpected end of template\. .*'for'",
    ),
    (
        "plan-moe-config-without-experts",
        lambda c: ["plan", c.config(model_name_or_path=c.moe_folder(experts=0))],
        r"lora_target_modules=\[.*\] is invalid: PEFT renames \['up_proj', 'down_proj'\] for every 'qwen3_moe' model "
        r"to its fused MoE expert parameters .* \(no MoE experts: every MLP is dense.*target only \['q_proj', "
        r"'k_proj', 'v_proj'\]",
    ),
    (
        "lora-target-modules-empty",  # refused up front, not by PEFT once the model has loaded
        lambda c: ["train", c.config(lora_target_modules=[])],
        r"lora_target_modules=\[\] is invalid: name at least one module to adapt",
    ),
    # silent: an unknown key in any block, a string for a list, two settings of which one would be ignored
    (
        "ablate-unknown-block-key",
        lambda c: ["ablate", ablation_config(c, {"runs": ["lora"], "evaluation": {"tasks": ["boolq"]}})],
        r"ablation has unknown keys \['evaluation'\]: they are none of its keys \(runs, output_dir, eval\)\. For "
        r"evaluation, did you mean eval\?",
    ),
    (
        "ablate-runs-misspelt",
        lambda c: ["ablate", ablation_config(c, {"run": ["lora"]})],
        r"ablation has unknown keys \['run'\].*For run, did you mean runs\?",
    ),
    (
        "ablate-unknown-eval-key",
        lambda c: ["ablate", ablation_config(c, {"runs": ["lora"], "eval": {"task": ["boolq"], "kl_text": "x"}})],
        r"ablation\.eval has unknown keys \['task'\].*For task, did you mean tasks\?",
    ),
    (
        "ablate-mt-bench-key-misspelt",
        lambda c: ["ablate", ablation_config(c, {"runs": ["lora"], "eval": {"mt_bench": {"judge_modle": "gpt-4"}}})],
        r"ablation\.eval\.mt_bench has unknown keys \['judge_modle'\].*did you mean judge_model\?",
    ),
    (
        "ablate-tasks-a-string",
        lambda c: [
            "ablate",
            ablation_config(c, {"runs": ["lora"], "eval": {"commonsense_dir": str(c.tmp), "tasks": "boolq"}}),
        ],
        r"ablation\.eval\.tasks='boolq' is invalid: give a list\. Write it as a YAML list: `tasks: \[boolq\]`",
    ),
    (
        "ablate-tasks-twice",
        lambda c: [
            "ablate",
            ablation_config(
                c, {"runs": ["lora"], "eval": {"commonsense_dir": str(c.tmp), "tasks": ["boolq", "boolq"]}}
            ),
        ],
        r"ablation\.eval\.tasks=\['boolq', 'boolq'\] is invalid: 'boolq' is listed 2 times",
    ),
    (
        "ablate-commonsense-dir-without-tasks",
        lambda c: ["ablate", ablation_config(c, {"runs": ["lora"], "eval": {"commonsense_dir": str(c.tmp)}})],
        r"ablation\.eval\.commonsense_dir='.*' is invalid: it applies only with ablation\.eval\.tasks",
    ),
    (
        "ablate-kl-max-tokens-without-kl-text",
        lambda c: ["ablate", ablation_config(c, {"runs": ["lora"], "eval": {"kl_max_tokens": 64}})],
        r"ablation\.eval\.kl_max_tokens=64 is invalid: it applies only with ablation\.eval\.kl_text",
    ),
    (
        "list-key-given-a-string",  # PEFT would read each letter of 'lm_head' as a module name
        lambda c: ["train", c.config(lora_modules_to_save="lm_head")],
        r"lora_modules_to_save='lm_head' is invalid: give a list\. Write it as a YAML list: "
        r"`lora_modules_to_save: \[lm_head\]`",
    ),
    (
        "layers-with-a-strategy",
        lambda c: ["train", c.config(fora_layers=[0, 1], fora_layer_strategy="random")],
        r"layer_strategy='random' is invalid: layers=\[0, 1\] is set too, and the 'random' strategy chooses the "
        r"layers itself\. Drop layers or layer_strategy",
    ),
    (
        "scores-path-with-a-strategy",
        lambda c: [
            "train",
            c.config(
                fora_scores_path=c.file("s.json", json.dumps({"scores": [1.0, 2.0]})), fora_layer_strategy="first"
            ),
        ],
        r"layer_strategy='first' is invalid: scores_path='.*s\.json' is set too",
    ),
    (
        "all-layers-mode-with-a-strategy",
        lambda c: ["train", c.config(fora_mode="lora", fora_layer_strategy="last")],
        r"layer_strategy='last' is invalid: mode='lora' adapts every layer, so it would be ignored",
    ),
    (
        "deepspeed-with-fsdp",
        lambda c: ["train", c.config(), "--deepspeed", ds_config(c, 2), "--fsdp", "full_shard"],
        r"fsdp=.* and deepspeed='.*zero2\.json' are both set, and a run shards its model with one engine",
    ),
    (
        "plan-deepspeed-with-fsdp",
        lambda c: ["plan", c.config(), "--deepspeed", ds_config(c, 2), "--fsdp", "full_shard"],
        r"fsdp='full_shard' and deepspeed='.*zero2\.json' are both set",
    ),
    (
        "eval-mt-bench-pairwise-without-compare",
        lambda c: c.eval("--mt-bench", "--mt-bench-pairwise"),
        r"--mt-bench-pairwise=True is invalid: it judges --model-id head to head against each --mt-bench-compare "
        r"model, and none is given",
    ),
    (
        "eval-mt-bench-compare-with-itself",
        lambda c: c.eval("--mt-bench", "--judge-model", "j", "--mt-bench-compare", "fora"),
        r"--mt-bench-compare=\['fora'\] is invalid: 'fora' is named twice \(or is --model-id itself\)",
    ),
    (
        "eval-mt-bench-option-without-mt-bench",
        lambda c: c.eval("--mt-bench-first-n", "2"),
        r"--mt-bench-first-n applies to MT-Bench answers, and --mt-bench is not given",
    ),
    (
        "eval-judging-option-without-a-judge",
        lambda c: c.eval("--mt-bench", "--judge-timeout", "5"),
        r"--judge-timeout is set but no judge is \(--judge-model is not\)",
    ),
    (
        "eval-perplexity-option-without-wikitext",
        lambda c: c.eval("--ppl-stride", "16"),
        r"--ppl-stride=16 is invalid: it applies with --wikitext only, which is not given",
    ),
    (
        "eval-task-without-an-answer-format",  # refused after every answer was generated, before
        lambda c: [
            "eval",
            "--base",
            str(c.shared / "model"),
            "--commonsense-dir",
            str(Path(c.file("cs/boolqa/test.json", json.dumps([{"instruction": "x", "answer": "true"}]))).parents[1]),
            "--tasks",
            "boolqa",
        ],
        r"task='boolqa' is invalid: there is no answer format for it",
    ),
    (
        "eval-task-examples-without-answers",  # a KeyError after the model loaded, before
        lambda c: [
            "eval",
            "--base",
            str(c.shared / "model"),
            "--commonsense-dir",
            str(Path(c.file("cs/boolq/test.json", json.dumps([{"instruction": "x", "label": "true"}]))).parents[1]),
            "--tasks",
            "boolq",
        ],
        r"boolq/test\.json: example 0 has no string 'answer' \(it holds \['instruction', 'label'\]\)",
    ),
    (
        "eval-tasks-twice",
        lambda c: c.eval("--tasks", "boolq,boolq"),
        r"--tasks='boolq,boolq' is invalid: 'boolq' is named twice",
    ),
    (
        "report-base-without-kl-text",
        lambda c: ["report", c.adapter(), "--base", str(c.shared / "model")],
        r"--base='.*model' is invalid: it is used for the KL on --kl-text only",
    ),
    # lost: nothing a command writes replaces another run's files, and two inputs never share one output name
    (
        "score-into-a-finished-run",  # its fora_scores.json and .png are the record of the adapter beside them
        lambda c: ["score", c.config()],
        r"output_dir='.*out' is invalid: it holds a trained adapter \(adapter_config\.json\) whose fora_scores\.json "
        r"records the layers it was trained on.*--output_dir .*out/rescored",
    ),
    (
        "eval-output-holds-another-commands-results",
        lambda c: c.eval("--output", str(c.tmp / "out")),
        r"--output='.*out' is invalid: it holds a results\.json that `fora eval` did not write",
    ),
    (
        "report-the-same-adapter-twice",
        lambda c: ["report", c.adapter(), "--vs", str(c.tmp / "adapter")],
        r"--vs='.*adapter' is invalid: this adapter folder is given twice",
    ),
    # a path the operating system refuses
    (
        "output-dir-name-too-long",
        lambda c: ["train", c.config(output_dir=str(c.tmp / ("o" * 300)))],
        r"output_dir='.*ooo' is invalid: the operating system refuses it \(File name too long\)\. Use a shorter path",
    ),
    (
        "config-path-too-long",
        lambda c: ["train", str(c.tmp / ("c" * 300 + ".yaml"))],
        r"config='.*ccc\.yaml' is invalid: the operating system refuses it \(File name too long\)",
    ),
    (
        "dataset-name-too-long",
        lambda c: ["score", c.config(dataset_name=str(c.tmp / ("d" * 300 + ".json")))],
        r"dataset_name='.*ddd\.json' is invalid: the operating system refuses it \(File name too long\)",
    ),
    (
        "model-path-too-long",
        lambda c: ["train", c.config(model_name_or_path=str(c.tmp / ("m" * 300)))],
        r"model_name_or_path='.*mmm' is invalid: the operating system refuses it \(File name too long\)",
    ),
    (
        "eval-output-too-long",
        lambda c: c.eval("--output", str(c.tmp / ("e" * 300))),
        r"--output='.*eee' is invalid: the operating system refuses it",
    ),
]


def checkpoint_of(ctx: Ctx, run: str) -> str:
    """A checkpoint-1 folder as `fora train` saves one in output_dir ``run``: the adapter (both layers), the FoRA
    selection and the trainer's state."""
    folder = ctx.tmp / run / "checkpoint-1"
    ctx.adapter(folder=folder)
    selection = {"mode": "fora", "source": "fisher", "num_layers": 2, "k": 2, "chosen_layers": [0, 1], "scores": None}
    (folder / "fora_scores.json").write_text(json.dumps(selection))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    return str(folder)


def learning_rate_as_yaml_writes_it(ctx: Ctx) -> str:
    """A config whose `learning_rate: 2e-4` PyYAML reads as a string (YAML 1.1 floats need a dot)."""
    path = ctx.file("lr.yaml", Path(ctx.config(output_dir=str(ctx.tmp / "run"))).read_text() + "learning_rate: 2e-4\n")
    assert yaml.safe_load(Path(path).read_text())["learning_rate"] == "2e-4"
    return path


def scored(folder: Path) -> bool:
    return json.loads((folder / "fora_scores.json").read_text())["source"] == "fisher"


EARLIER_EVAL = json.dumps({"base": "earlier-model", "adapter": None, "perplexity": {"perplexity": 12.5}})

# Valid inputs a user may find unusual: (id, command line from a Ctx, what the run left, checked). Each runs (exit
# code 0) and leaves the earlier run in out/ byte-identical.
VALID: list[tuple[str, Callable[[Ctx], list[str]], Callable[[Ctx], bool]]] = [
    (
        "unicode-output-path",
        lambda c: ["score", c.config(output_dir=str(c.tmp / "résultats ü" / "运行"))],
        lambda c: scored(c.tmp / "résultats ü" / "运行"),
    ),
    (
        "extra-dataset-columns",
        lambda c: [
            "score",
            c.config(
                dataset_name=c.file(
                    "extra.json", json.dumps([{**r, "id": i, "tags": ["sum"]} for i, r in enumerate(ROWS)])
                ),
                output_dir=str(c.tmp / "scored"),
            ),
        ],
        lambda c: scored(c.tmp / "scored"),
    ),
    (
        "learning-rate-as-yaml-writes-it",
        lambda c: ["train", learning_rate_as_yaml_writes_it(c)],
        lambda c: (
            (c.tmp / "run" / "adapter_model.safetensors").is_file()
            and parse_config(str(c.tmp / "lr.yaml"), [])[1].learning_rate == 2e-4
        ),
    ),
    (
        "adapter-given-as-a-checkpoint-folder",
        lambda c: ["report", checkpoint_of(c, "run")],
        lambda c: list(json.loads((c.tmp / "run" / "checkpoint-1" / "report.json").read_text())) == ["checkpoint-1"],
    ),
    (
        "eval-adapter-given-as-a-checkpoint-folder",
        lambda c: [*c.perplexity("--adapter", checkpoint_of(c, "run")), "--output", str(c.tmp / "ev")],
        lambda c: json.loads((c.tmp / "ev" / "results.json").read_text())["perplexity"]["perplexity"] > 1,
    ),
    (
        "eval-into-a-folder-an-earlier-eval-wrote",  # its results are kept beside, as results.1.json/.md
        lambda c: c.perplexity("--output", c.earlier_eval("ev")),
        lambda c: (
            (c.tmp / "ev" / "results.1.json").read_text() == EARLIER_EVAL
            and (c.tmp / "ev" / "results.1.md").read_text() == "| earlier |"
            and json.loads((c.tmp / "ev" / "results.json").read_text())["perplexity"]["perplexity"] > 1
        ),
    ),
    (
        "report-two-checkpoints-of-one-name",  # two labels, not one checkpoint-1 replacing the other
        lambda c: ["report", checkpoint_of(c, "a"), "--vs", checkpoint_of(c, "b"), "--output", str(c.tmp / "rep")],
        lambda c: (
            sorted(json.loads((c.tmp / "rep" / "report.json").read_text())) == ["a/checkpoint-1", "b/checkpoint-1"]
        ),
    ),
    (
        "chat-template-path-names-a-tokenizer-folder",  # TRL clones that tokenizer's template: the rows render with it
        lambda c: [
            "score",
            c.config(
                dataset_name=c.file("chat.json", json.dumps([{"messages": t} for t in CHAT])),
                chat_template_path=c.model_variant(chat_template=STRICT_TEMPLATE),
                output_dir=str(c.tmp / "scored"),
            ),
        ],
        lambda c: scored(c.tmp / "scored"),
    ),
    (
        "dataset-save-to-disk-folder",  # loaded with datasets.load_from_disk
        lambda c: ["score", c.config(dataset_name=c.save_to_disk(), output_dir=str(c.tmp / "scored"))],
        lambda c: scored(c.tmp / "scored"),
    ),
]


@pytest.mark.parametrize("build, check", [c[1:] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_unusual_input_runs_and_leaves_the_earlier_run_as_it_was(
    shared, tmp_path, capsys, monkeypatch, offline, build, check
):
    monkeypatch.chdir(tmp_path)
    earlier_run(tmp_path / "out")
    ctx = Ctx(shared, tmp_path)
    argv = build(ctx)
    before = snapshot(tmp_path / "out")
    assert main(argv) == 0, capsys.readouterr().err
    assert snapshot(tmp_path / "out") == before
    assert check(ctx)


@pytest.fixture
def offline(monkeypatch):
    """No hub: a dataset name that is not a local file fails at once instead of after network retries."""
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize("build, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gives_exit_2_and_a_message(shared, tmp_path, capsys, monkeypatch, offline, build, message):
    monkeypatch.chdir(tmp_path)  # `fora eval`'s default --output (outputs/eval) lands in the row's scratch folder
    earlier_run(tmp_path / "out")  # the config's output_dir holds an earlier run
    argv = build(Ctx(shared, tmp_path))
    before = snapshot(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, f"exit code {code} for {argv}; stderr:\n{err}"
    assert "Traceback" not in err and "usage:" not in err and "fail_with_unknown_args" not in err, err
    (line,) = [x for x in err.splitlines() if ": error: " in x]  # one line says what is wrong
    assert line.startswith(f"fora {argv[0]}: error: "), line
    assert re.search(message, line), err
    # A refused run changes nothing that was there: the earlier run's files (and every other file) are unchanged.
    assert snapshot(tmp_path) == before


# What the README promises for these: refused before the model loads (each was refused after it, or not at all).
BEFORE_THE_MODEL = (
    "dataset-sharegpt-roles-against-the-chat-template",
    "dataset-messages-as-strings",
    "resume-at-another-rank",
    "eval-mt-bench-chat-template-unclosed",
    "lora-target-modules-empty",
    "eval-task-without-an-answer-format",
    "eval-task-examples-without-answers",
    "cuda-graph-without-a-gpu",
    "chat-template-path-a-missing-jinja-file",
)


@pytest.mark.parametrize("row", BEFORE_THE_MODEL)
def test_these_are_refused_before_any_model_loads(shared, tmp_path, capsys, monkeypatch, offline, row):
    from transformers import PreTrainedModel

    monkeypatch.chdir(tmp_path)
    earlier_run(tmp_path / "out")
    _, build, message = next(c for c in CASES if c[0] == row)
    argv = build(Ctx(shared, tmp_path))  # the row's files first: some are made with the model

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", loaded)
    assert main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_run_that_fails_after_scoring_leaves_the_output_folder_as_it_was(shared, tmp_path, monkeypatch, offline):
    # The case: a run that crashed once training started had already written fora_scores.json/.png for
    # its new layers next to the earlier run's adapter. Our own failure keeps its traceback (an exception here).
    from transformers import Trainer

    def crash(self, *args, **kwargs):
        raise RuntimeError("the disk is full")

    earlier_run(tmp_path / "out")
    before = snapshot(tmp_path / "out")
    monkeypatch.setattr(Trainer, "train", crash)
    with pytest.raises(RuntimeError, match="the disk is full"):
        main(["train", Ctx(shared, tmp_path).config()])  # Fisher scoring runs, then training fails
    assert snapshot(tmp_path / "out") == before


@pytest.mark.slow
def test_a_finished_run_writes_the_selection_of_its_adapter_and_fora_report_takes_it(shared, tmp_path, offline):
    from fora_plugin.report import adapter_report

    out = tmp_path / "out"
    earlier_run(out)
    assert main(["train", Ctx(shared, tmp_path).config()]) == 0
    selection = json.loads((out / "fora_scores.json").read_text())
    assert selection["chosen_layers"] == adapter_report(out)["adapted_layers"] and selection["scores"] != [1, 2]
    assert (out / "fora_scores.png").read_bytes() != b"\x89PNG earlier plot"
    assert main(["report", str(out)]) == 0


@pytest.mark.parametrize(
    "targets", [{}, {"lora_target_parameters": EXPERT_PARAMETERS, "lora_dropout": 0.0}], ids=["qkv", "qkv-experts"]
)
def test_a_float32_moe_plan_plans_like_the_bfloat16_one(tmp_path, targets):
    """The plan of a 2-expert Qwen3-MoE in float32 (the quickstart's dtype), whose fused experts' grouped matmul takes
    bf16 inputs only on the CPU ("Expected inputs of BF16 type"): it plans, with the FLOPs of the bfloat16 plan and
    float32 weights."""
    model = tiny_moe(num_layers=2, num_experts=2)
    model.config.save_pretrained(tmp_path / "moe")
    payloads = {}
    for dtype in ("float32", "bfloat16"):
        keys = {"model_name_or_path": str(tmp_path / "moe"), "dtype": dtype, "lora_r": 2, "lora_alpha": 4}
        keys.update({"lora_target_modules": ["q_proj", "k_proj", "v_proj"], "per_device_train_batch_size": 2})
        keys.update({"max_length": 16, "output_dir": str(tmp_path / dtype), "report_to": "none", **targets})
        config = tmp_path / f"{dtype}.yaml"
        config.write_text(yaml.safe_dump(keys))
        assert main(["plan", str(config)]) == 0
        payloads[dtype] = json.loads((tmp_path / dtype / "plan.json").read_text())
    fp32, bf16 = payloads["float32"]["phases"], payloads["bfloat16"]["phases"]
    assert fp32.keys() == bf16.keys() == {"fora", "fg-lora", "lora"}
    for mode, phases in fp32.items():
        for name, phase in phases.items():
            assert phase["flops"] == bf16[mode][name]["flops"] > 0
    weights = sum(p.numel() * 4 for p in model.parameters()) + sum(b.numel() * 4 for b in model.buffers())
    assert fp32["lora"]["step"]["by_kind_bytes"]["weights"] == weights


def test_one_valid_target_name_reaches_peft_as_a_list(shared, tmp_path):
    """The other side of the target-module-one-name rows: `--lora_target_modules q_proj` (or a YAML `[q_proj]`,
    which TRL turns into "q_proj") is the name q_proj for PEFT, not a regex that matches no module."""
    from fora_plugin.recipe import parse_config

    config = Ctx(shared, tmp_path).config(drop=("lora_target_modules",))
    assert parse_config(config, ["--lora_target_modules", "q_proj"])[2].lora_target_modules == ["q_proj"]
    config = Ctx(shared, tmp_path).config(lora_target_modules=["v_proj"])
    assert parse_config(config, [])[2].lora_target_modules == ["v_proj"]
