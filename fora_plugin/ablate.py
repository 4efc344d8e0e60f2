"""``fora ablate``: the paper's 2x2 ablation and its controls, trained and evaluated from one config.

Runs (one seed): ``lora`` (all layers), ``fg-lora`` (Fisher layers), ``stiefel-lora`` (all layers, Stiefel),
``fora``, ``lora-half-rank`` (r/2 on all layers: FoRA's parameter count), ``random-k`` (FoRA on K random layers),
and PEFT's ``dora`` and ``rslora``. Each is trained with ``fora train``'s trainer, saved, and evaluated: trainable
parameters, training time, held-out completion loss, commonsense accuracy, mean effective rank of ΔW, and
KL(p_trained ‖ p_base). The effective rank is that of the merged ΔW (merged minus base weight), so DoRA's magnitude
rescaling counts as it does in the model. A run whose ``results.json`` exists is not trained again, so an interrupted
ablation resumes.

May import: config, errors, evaluation, files, mt_bench, plots, recipe, report, validation.
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from . import mt_bench
from .config import MODE_PARTS
from .errors import FoRAInputError, refuse
from .evaluation import check_commonsense_examples, commonsense_accuracy, completion_loss
from .files import check_file, check_nonblank_text, check_output_folder, check_text_file, read_json
from .plots import pyplot
from .recipe import build_trainer, load_yaml_config, parse_config
from .report import adapter_report, kl_to_base, merged_mean_effective_rank
from .validation import (
    check_block,
    check_numbers,
)


__all__ = [
    "ABLATION_EVAL_KEYS",
    "ABLATION_KEYS",
    "RUNS",
    "ablation_table",
    "check_ablation_block",
    "evaluate_run",
    "load_ablation_config",
    "plot_ablation",
    "run_ablation",
    "run_config",
    "run_overrides",
]


RUNS = ("lora", "fg-lora", "stiefel-lora", "fora", "lora-half-rank", "random-k", "dora", "rslora")
# The keys of the `ablation:` block and of its `eval:` block; the numbers' rules are validation.NUMBER_RULES'.
ABLATION_KEYS = ("runs", "output_dir", "eval")
ABLATION_EVAL_KEYS = (
    "commonsense_dir",
    "tasks",
    "max_examples",
    "batch_size",
    "max_new_tokens",
    "eval_loss_examples",
    "kl_text",
    "kl_max_tokens",
    "mt_bench",
)
_EVAL_NUMBERS = ("max_examples", "batch_size", "max_new_tokens", "kl_max_tokens", "eval_loss_examples")
# eval keys that apply only with another one: key -> the key it needs.
_EVAL_NEEDS = {
    "tasks": "commonsense_dir",
    "commonsense_dir": "tasks",
    "max_examples": "tasks",
    "batch_size": "tasks",
    "max_new_tokens": "tasks",
    "eval_loss_examples": "tasks",
    "kl_max_tokens": "kl_text",
}
# The fora_* keys that say how the layers are chosen: a run that adapts every layer, or picks its own, drops them.
_SELECTION_KEYS = ("fora_layers", "fora_scores_path", "fora_layer_strategy")


def run_overrides(name: str, lora_r: int, lora_alpha: int) -> list[str]:
    """The command-line overrides that turn the config into run ``name``."""
    table = {
        "lora": ["--fora_mode", "lora"],
        "fg-lora": ["--fora_mode", "fg-lora"],
        "stiefel-lora": ["--fora_mode", "stiefel-lora"],
        "fora": ["--fora_mode", "fora"],
        # Half the rank on every layer: the parameter count of FoRA's full rank on half the layers, same α/r.
        "lora-half-rank": [
            "--fora_mode",
            "lora",
            "--lora_r",
            str(max(1, lora_r // 2)),
            "--lora_alpha",
            str(max(1, lora_alpha // 2)),
        ],
        "random-k": ["--fora_mode", "fora", "--fora_layer_strategy", "random"],
        "dora": ["--fora_mode", "lora", "--use_dora", "true"],
        "rslora": ["--fora_mode", "lora", "--use_rslora", "true"],
    }
    if name not in table:
        raise FoRAInputError(f"ablation run {name!r} is unknown; use some of {list(RUNS)}.")
    return table[name]


def run_config(data: dict[str, Any], name: str) -> dict[str, Any]:
    """The training config of run ``name``: the shared one without the layer-choosing keys the run decides itself
    (every layer for the all-layer runs, K random layers for random-k), which its mode or strategy would refuse."""
    overrides = run_overrides(name, 2, 2)
    every_layer = not MODE_PARTS[overrides[overrides.index("--fora_mode") + 1]][0]
    if every_layer or "--fora_layer_strategy" in overrides:
        return {k: v for k, v in data.items() if k not in _SELECTION_KEYS}
    return dict(data)


def check_ablation_block(block: Any, config: str, runs: tuple[str, ...] = RUNS) -> None:
    """Refuse an ``ablation:`` block with an unknown key (a misspelt ``runs`` or ``eval`` would be ignored), no runs,
    unknown or repeated runs, a bad output_dir, an ``eval:`` block with an unknown key, tasks that are not a list or
    repeat one, a key that applies only with another that is missing, or out-of-range numbers."""
    check_block(block, ABLATION_KEYS, "ablation", lists=("runs",))
    if "runs" in block:
        given = block["runs"]
        if not isinstance(given, list) or not given:
            refuse(
                "ablation.runs",
                given,
                f"give a non-empty list of runs (some of {list(runs)})",
                f"In {config}: `runs: [lora, fora]`, or remove `runs` for all of them.",
            )
        unknown = [r for r in given if r not in runs]
        if unknown:
            raise FoRAInputError(f"ablation runs {unknown} are unknown; use some of {list(runs)}.")
        _check_once("ablation.runs", given, "each run trains once and is one table row")
    if "output_dir" in block:
        check_output_folder(str(block["output_dir"]), "ablation.output_dir")
    evaluation = block.get("eval")
    if evaluation is None:
        return
    check_block(evaluation, ABLATION_EVAL_KEYS, "ablation.eval", lists=("tasks",))
    tasks = evaluation.get("tasks")
    if tasks is not None:
        bad = [t for t in tasks if not isinstance(t, str) or not t.strip()]
        if bad:
            refuse("ablation.eval.tasks", tasks, f"{bad[0]!r} is not a task name", "List task folder names.")
        _check_once("ablation.eval.tasks", tasks, "each task is evaluated once and is one table column")
    check_numbers(evaluation, _EVAL_NUMBERS, prefix="ablation.eval.")
    for key, needed in _EVAL_NEEDS.items():
        if evaluation.get(key) in (None, 0) and key == "eval_loss_examples":
            continue  # 0: no held-out loss, which needs no tasks
        if evaluation.get(key) is not None and evaluation.get(needed) in (None, [], ""):
            refuse(
                f"ablation.eval.{key}",
                evaluation[key],
                f"it applies only with ablation.eval.{needed}, which is not set, so it would be ignored",
                f"Set {needed} too, or drop {key}.",
            )


def _check_once(key: str, given: list, why: str) -> None:
    twice = sorted({str(r) for r in given if given.count(r) > 1})
    if twice:
        refuse(
            key,
            given,
            f"{twice[0]!r} is listed {given.count(twice[0])} times: {why}",
            f"List each once, e.g. `{key.rsplit('.', 1)[-1]}: [{', '.join(map(str, dict.fromkeys(given)))}]`.",
        )


def _resolve(path: str, base: Path) -> str:
    candidate = Path(path)
    if not candidate.is_absolute() and not candidate.exists() and (base / candidate).exists():
        return str(base / candidate)
    return path


def load_ablation_config(config: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the training config, the ``ablation`` block) with paths made absolute against the config's folder."""
    path = Path(config)
    data = load_yaml_config(config)
    block = data.pop("ablation", None)
    if not isinstance(block, dict):
        raise FoRAInputError(
            f"{config} has no `ablation:` block: add one with `runs`, `output_dir` and `eval` "
            "(see example_configs/ablation_gemma270m.yaml)."
        )
    check_ablation_block(block, config)
    base = path.resolve().parent
    if not data.get("dataset_name"):
        raise FoRAInputError(f"{config} has no dataset_name: name a local .json/.jsonl file or a `datasets` name.")
    data["dataset_name"] = _resolve(data["dataset_name"], base)
    evaluation = block.get("eval") or {}
    block["eval"] = evaluation
    for key in ("commonsense_dir", "kl_text"):
        if evaluation.get(key):
            evaluation[key] = _resolve(evaluation[key], base)
    if evaluation.get("kl_text"):  # read after the first run trained: checked now
        check_file(evaluation["kl_text"], "ablation.eval.kl_text")
        check_nonblank_text(evaluation["kl_text"], "ablation.eval.kl_text")
    if evaluation.get("mt_bench") is not None:
        judged = evaluation["mt_bench"]
        for key in ("questions", "reference", "chat_template"):
            if isinstance(judged, dict) and judged.get(key):
                judged[key] = _resolve(judged[key], base)
        # Refused here, before any training.
        mt_bench.MTBenchConfig.from_dict(judged, f"{config}: ablation.eval.mt_bench")
    return data, block


def _check_training_keys(data: dict[str, Any], overrides: list[str], config: str, runs: list[str]) -> None:
    """The training keys and overrides every run shares, then each of ``runs`` with its own settings, checked
    (messages naming ``config``) before the ablation writes anything: otherwise a run would refuse them after the
    runs before it trained."""
    with tempfile.TemporaryDirectory() as scratch:
        derived = Path(scratch) / "train_config.yaml"
        derived.write_text(yaml.safe_dump(data, sort_keys=False))
        parse_config(str(derived), list(overrides), shown_as=config)
        for name in runs:
            derived.write_text(yaml.safe_dump(run_config(data, name), sort_keys=False))
            args = run_overrides(name, data.get("lora_r", 16), data.get("lora_alpha", 32))
            try:
                parse_config(str(derived), [*args, *overrides], shown_as=config)
            except FoRAInputError as error:
                raise FoRAInputError(f"ablation run {name!r} ({' '.join(args)}): {error}") from None


def _held_out(evaluation: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    tasks = evaluation.get("tasks", [])
    folder = Path(evaluation.get("commonsense_dir", ""))
    limit = evaluation.get("max_examples")
    held_out = {}
    for task in tasks:
        file = folder / task / "test.json"
        if not file.is_file():
            raise FoRAInputError(f"No test file for task {task!r} at {file}.")
        # The held-out loss reads each example's output too.
        fields = (
            ("instruction", "answer", "output")
            if evaluation.get("eval_loss_examples", 40)
            else ("instruction", "answer")
        )
        held_out[task] = check_commonsense_examples(task, read_json(file), str(file), fields)[:limit]
    return held_out


def evaluate_run(trainer, evaluation: dict[str, Any], held_out: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    model, tokenizer = trainer.model, trainer.processing_class
    result: dict[str, Any] = {}
    loss_examples = [e for examples in held_out.values() for e in examples][: evaluation.get("eval_loss_examples", 40)]
    if loss_examples:
        result["eval_loss"] = completion_loss(model, tokenizer, loss_examples)
    result["accuracy"] = {
        task: commonsense_accuracy(
            model,
            tokenizer,
            examples,
            task,
            max_new_tokens=evaluation.get("max_new_tokens", 16),
            batch_size=evaluation.get("batch_size", 8),
        )
        for task, examples in held_out.items()
    }
    if evaluation.get("kl_text"):
        text = check_text_file(evaluation["kl_text"], "ablation.eval.kl_text")
        result["kl_to_base"] = kl_to_base(model, tokenizer, text, max_tokens=evaluation.get("kl_max_tokens", 512))
    return result


def run_ablation(config: str, overrides: list[str]) -> Path:
    """Train and evaluate every run of the config's ablation; returns the folder holding the table and plot."""
    data, block = load_ablation_config(config)
    out = Path(block.get("output_dir", "outputs/ablation"))
    check_output_folder(out, "ablation.output_dir")
    evaluation = block["eval"]
    held_out = _held_out(evaluation)  # a missing or malformed task file is refused before anything is written
    judge = _mt_bench_prepared(evaluation)  # questions, references, key and judge server too
    runs = [name for name in block.get("runs", RUNS) if not (out / name / "results.json").is_file()]
    _check_training_keys(data, overrides, config, runs)
    out.mkdir(parents=True, exist_ok=True)
    train_config = out / "train_config.yaml"
    train_config.write_text(yaml.safe_dump(data, sort_keys=False))
    results = {}
    for name in block.get("runs", RUNS):
        run_dir = out / name
        done = run_dir / "results.json"
        if done.is_file():
            print(f"[{name}] finished earlier: {done}")
            results[name] = json.loads(done.read_text())
            continue
        print(f"\n[{name}] training")
        args = run_overrides(name, data.get("lora_r", 16), data.get("lora_alpha", 32))
        own = run_config(data, name)
        config_file = train_config
        if own != data:  # the run's own config, without the keys it decides itself, kept with its outputs
            run_dir.mkdir(parents=True, exist_ok=True)
            config_file = run_dir / "train_config.yaml"
            config_file.write_text(yaml.safe_dump(own, sort_keys=False))
        trainer = build_trainer(str(config_file), [*args, *overrides, "--output_dir", str(run_dir)])
        started = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - started
        trainer.save_model(str(run_dir))
        adapter = adapter_report(run_dir)
        result = {
            "run": name,
            "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "train_seconds": train_seconds,
            "train_loss": trainer.state.log_history[-1].get("train_loss"),
            "adapted_layers": adapter["adapted_layers"],
            # Of the merged ΔW, not of B·A alone: DoRA's ΔW includes its magnitude rescaling.
            "mean_effective_rank": merged_mean_effective_rank(trainer.model),
        }
        print(f"[{name}] evaluating")
        result.update(evaluate_run(trainer, evaluation, held_out))
        if judge is not None:
            result["mt_bench"] = _mt_bench_run(judge, trainer, out, name, run_dir)
        done.write_text(json.dumps(result, indent=2))
        results[name] = result
        del trainer
        gc.collect()
    table = ablation_table(results, list(held_out))
    if judge is not None:
        table += "\n\n" + _mt_bench_table(judge, out, list(results))
    (out / "ablation.md").write_text(table + "\n")
    plot_ablation(out / "ablation.png", results)
    print("\n" + table)
    print(f"\ntable: {(out / 'ablation.md').resolve()}\nplot:  {(out / 'ablation.png').resolve()}")
    return out


def _mt_bench_prepared(evaluation: dict[str, Any]):
    """The ``eval.mt_bench`` block checked (files, key, judge server) before the first run is trained."""
    if evaluation.get("mt_bench") is None:
        return None
    return mt_bench.prepare(mt_bench.MTBenchConfig.from_dict(evaluation["mt_bench"], "ablation.eval.mt_bench"))


def _mt_bench_run(prepared, trainer, out: Path, name: str, run_dir: Path) -> dict[str, Any]:
    """MT-Bench answers of run ``name`` (model_id = the run's name) in ``out/mt_bench``, judged if a judge is set."""
    config = prepared.config
    source = {
        "adapter": str(run_dir.resolve()),
        "max_new_tokens": config.max_new_tokens,
        "chat_template": config.chat_template,
    }
    result = mt_bench.run(prepared, trainer.model, trainer.processing_class, out / "mt_bench", name, source)
    return {k: v for k, v in result.items() if k != "markdown"}


def _mt_bench_table(prepared, out: Path, names: list[str]) -> str:
    """All runs' MT-Bench scores in one table and one plot (out/mt_bench/mt_bench.png); judgments are cached."""
    answered = [n for n in names if (out / "mt_bench" / "model_answer" / f"{n}.jsonl").is_file()]
    if prepared.client is None or not answered:
        return ""
    scored = mt_bench.score(prepared, out / "mt_bench", answered)
    return "MT-Bench:\n\n" + scored["markdown"] + f"\n\nplot: {scored['plot']}"


def ablation_table(results: dict[str, dict[str, Any]], tasks: list[str]) -> str:
    head = ["run", "trainable params", "layers", "train s", "eval loss", *tasks, "mean acc", "erank", "KL"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, r in results.items():
        acc = [r["accuracy"][t]["accuracy"] for t in tasks if t in r.get("accuracy", {})]
        cells = [
            name,
            f"{r['trainable_parameters']:,}",
            str(len(r["adapted_layers"])),
            f"{r['train_seconds']:.0f}",
            f"{r['eval_loss']:.3f}" if "eval_loss" in r else "-",
            *[f"{100 * a:.1f}" for a in acc],
            f"{100 * sum(acc) / len(acc):.1f}" if acc else "-",
            f"{r['mean_effective_rank']:.2f}",
            f"{r['kl_to_base']:.4f}" if "kl_to_base" in r else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_ablation(path: Path, results: dict[str, dict[str, Any]]) -> Path:
    plt = pyplot()

    names = list(results)
    params = [results[n]["trainable_parameters"] / 1e6 for n in names]
    losses = [results[n].get("eval_loss", float("nan")) for n in names]
    eranks = [results[n]["mean_effective_rank"] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=120)
    colors = ["#d62728" if n == "fora" else "#1f77b4" for n in names]
    for ax, values, title in zip(
        axes,
        (params, losses, eranks),
        ("trainable parameters (M)", "held-out completion loss", "mean effective rank of ΔW"),
    ):
        ax.bar(names, values, color=colors)
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=45, labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
