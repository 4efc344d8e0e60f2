"""The ``fora`` command line: ``train``, ``score``, ``plan``, ``eval``, ``report`` and ``ablate``.

A config is a ``trl sft`` config (``ScriptArguments`` + ``SFTConfig`` + ``ModelConfig`` keys) plus ``fora_*`` keys
(:class:`FoRAConfig`'s fields with a prefix). Any key can be overridden on the command line:
``fora train example_configs/quickstart.yaml --learning_rate 1e-4 --fora_layer_budget 4``.

May import: ablate, config, errors, evaluation, files, logfilters, models, mt_bench, plan, plots, recipe, report,
selection, validation, wiring.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import textwrap
import time
import warnings
from pathlib import Path

from . import __version__, mt_bench
from .ablate import run_ablation
from .config import FoRAArguments
from .errors import FoRAInputError, path_refusal, refuse
from .evaluation import (
    check_commonsense_examples,
    commonsense_accuracy,
    lm_eval_command,
    mt_bench_judge_command,
    perplexity,
)
from .files import check_nonblank_text, check_output_folder, check_text_file, read_json
from .logfilters import drop
from .models import check_model, load_model
from .plan import plan
from .plots import plot_fisher_scores
from .recipe import build_trainer
from .report import adapter_report, check_adapter_folder, kl_to_base, markdown_summary, plot_spectra
from .selection import SCORES_FILE, SCORES_PLOT, FoRASelection
from .validation import (
    check_number,
)
from .wiring import write_selection


__all__ = ["build_parser", "check_eval_arguments", "main"]

logger = logging.getLogger("fora_plugin")

# PEFT reads transformers' deprecated `is_gradient_checkpointing` property: silenced by its exact text and category.
_PEFT_DEPRECATION = r"`is_gradient_checkpointing` is deprecated"
# DeepSpeed's guess of the accelerator, logged whenever anything imports it. Only a launched process can be a DeepSpeed
# run (the recipe refuses one without a launcher), so in a single process the guess concerns nothing that runs.
_DEEPSPEED_LOGGER = "DeepSpeed"
_DEEPSPEED_ACCELERATOR_MESSAGE = "Setting accelerator to CPU"


def quiet_third_party_noise() -> None:
    """Silence the known third-party messages above by their exact text; other messages of those loggers still show.

    (bitsandbytes' kernel message is dropped by :mod:`fora_plugin.logfilters`, which the package imports first.)
    """
    if "RANK" not in os.environ:
        drop(_DEEPSPEED_LOGGER, _DEEPSPEED_ACCELERATOR_MESSAGE)
    warnings.filterwarnings("ignore", message=_PEFT_DEPRECATION, category=FutureWarning)


def fora_keys_help(width: int = 100) -> str:
    """The help of every `fora_*` key, from FoRAConfig's fields, so a new field shows up without editing this."""
    lines = ["FoRA keys (YAML `key: value` or `--key value`; FoRAConfig's fields):"]
    for f in dataclasses.fields(FoRAArguments):
        default = f.default if f.default is not dataclasses.MISSING else None
        lines.append(f"  --{f.name} (default: {default})")
        text = f.metadata.get("help", "")
        if f.metadata.get("choices"):
            text += f" Choices: {', '.join(map(str, f.metadata['choices']))}."
        lines.extend(
            textwrap.wrap(text, width, initial_indent=" " * 8, subsequent_indent=" " * 8, break_on_hyphens=False)
        )
    lines += [
        "",
        "TRL keys: every field of trl's ScriptArguments (dataset_name, ...), SFTConfig (training: learning_rate, "
        "max_steps, output_dir, deepspeed, ...) and ModelConfig (model_name_or_path, lora_r, lora_alpha, "
        "lora_target_modules, load_in_4bit, ...); `trl sft --help` lists them with their help.",
    ]
    return "\n".join(lines[:-1] + textwrap.wrap(lines[-1], width))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fora",
        description="FoRA: Fisher-selected layers and Stiefel-constrained LoRA for TRL, PEFT and Axolotl.",
    )
    parser.add_argument("--version", action="version", version=f"fora-plugin {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in (
        ("train", "score the layers, then train LoRA on the chosen ones and save the adapter"),
        ("score", f"score the layers only: print the table, write {SCORES_FILE} and {SCORES_PLOT}"),
    ):
        command = commands.add_parser(
            name,
            help=text,
            description=textwrap.fill(
                text + ". Extra --key value pairs override the config's keys (any SFTConfig, ModelConfig, "
                "ScriptArguments or fora_* key, listed below).",
                100,
            ),
            epilog=fora_keys_help(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_argument("config", help="YAML config in the shape of `trl sft` configs, plus fora_* keys")

    ablate = commands.add_parser(
        "ablate",
        help="train and evaluate the paper's ablation grid from one config",
        description="Train lora, fg-lora, stiefel-lora, fora, lora-half-rank, random-k, dora "
        "and rslora from one config (its `ablation:` block says which and how to evaluate), "
        "then write one table and one plot. Finished runs are not trained again.",
    )
    ablate.add_argument("config", help="a `fora train` config with an `ablation:` block")

    evaluate = commands.add_parser("eval", help="commonsense accuracy, WikiText-2 perplexity, MT-Bench answers")
    evaluate.add_argument("--base", required=True, help="base model: folder, hub name, .gguf, or the bundled Gemma")
    evaluate.add_argument("--adapter", help="a PEFT LoRA adapter folder (e.g. a `fora train` output_dir)")
    evaluate.add_argument("--output", default="outputs/eval", help="folder for results.json, results.md, answers")
    evaluate.add_argument("--commonsense-dir", help="folder of <task>/test.json in the LLM-Adapters format")
    evaluate.add_argument(
        "--tasks",
        default="boolq,ARC-Easy,ARC-Challenge,openbookqa",
        help="comma-separated commonsense tasks (default: %(default)s)",
    )
    evaluate.add_argument("--max-examples", type=int, help="examples per task (default: all)")
    evaluate.add_argument("--wikitext", help="raw text file for perplexity (e.g. wikitext-2 test.txt)")
    evaluate.add_argument("--ppl-max-length", type=int, default=1024, help="perplexity window (default: 1024)")
    evaluate.add_argument("--ppl-stride", type=int, default=512, help="perplexity stride (default: 512)")
    evaluate.add_argument("--ppl-max-tokens", type=int, help="score only the first N tokens of the text")
    evaluate.add_argument("--model-id", default="fora", help="model_id in the MT-Bench answers (default: fora)")
    evaluate.add_argument("--batch-size", type=int, default=8, help="generation batch size (default: 8)")
    evaluate.add_argument("--max-new-tokens", type=int, default=32, help="commonsense answer length (default: 32)")
    evaluate.add_argument("--lm-eval", action="store_true", help="print the equivalent lm-evaluation-harness command")
    mt_bench.add_arguments(evaluate)

    # ---- plan (fora_plugin/plan/) ----
    add_plan_parser(commands)
    # ---- end plan ----

    report = commands.add_parser("report", help="spectra, effective rank, drift and KL of LoRA adapters")
    report.add_argument("adapter", help="a PEFT LoRA adapter folder")
    report.add_argument("--vs", nargs="*", default=[], help="other adapters to compare with")
    report.add_argument("--base", help="base model, for KL(p_trained || p_base) on held-out text")
    report.add_argument("--kl-text", help="held-out text file for the KL (needs --base)")
    report.add_argument("--kl-max-tokens", type=int, default=1024, help="tokens of the KL text (default: 1024)")
    report.add_argument("--output", help="folder for report.json, report.md and PNGs (default: the adapter's)")
    return parser


# ---- plan (fora_plugin/plan/) -----------------------------------------------------------------------------
def add_plan_parser(commands) -> None:
    text = "memory per GPU and FLOPs of a run, on fake tensors at its real shapes: no GPU, no weights"
    command = commands.add_parser(
        "plan",
        help=text,
        description=textwrap.fill(
            text + ". Runs one Fisher scoring batch and one training step of fora, fg-lora and lora with FoRA's own "
            "code, builds the model from its config.json alone, and writes plan.json and plan.png. Extra --key "
            "value pairs override the config's keys, as for `fora train`.",
            100,
        ),
        epilog=fora_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument("config", help="a `fora train` YAML config (or an Axolotl one)")
    command.add_argument("--gpus", default="1", help="number of GPUs the run uses (default: 1)")
    command.add_argument("--gpu-memory", help="memory of one GPU in GiB, for the verdict (e.g. 80)")
    command.add_argument("--model-config", help="config.json of the model, when model_name_or_path has none here")
    command.add_argument("--output", help="folder for plan.json and plan.png (default: the config's output_dir)")
    command.add_argument(
        "--full-depth",
        action="store_true",
        help="run every decoder layer (default: a stack that repeats is run at three small depths and extrapolated, "
        "checked to lie on one line)",
    )


def plan_command(args: argparse.Namespace, overrides: list[str]) -> int:
    try:
        gpus = int(args.gpus)
    except ValueError:
        gpus = None
    if gpus is None or gpus < 1:
        raise FoRAInputError(f"--gpus {args.gpus}: give the number of GPUs, an integer >= 1.")
    gpu_memory = None
    if args.gpu_memory is not None:
        try:
            gpu_memory = float(args.gpu_memory)
        except ValueError:
            gpu_memory = None
        if gpu_memory is None or not gpu_memory > 0 or gpu_memory == float("inf"):
            raise FoRAInputError(
                f"--gpu-memory {args.gpu_memory}: give one GPU's memory in GiB, a number > 0 (e.g. 80)."
            )
    text, payload = plan(
        args.config,
        overrides,
        gpus=gpus,
        gpu_memory=gpu_memory,
        model_config=args.model_config,
        output=args.output,
        full_depth=args.full_depth,
    )
    print(text)
    out = Path(args.output) if args.output else Path(payload["output_dir"])
    print(f"\n  plan: {(out / 'plan.json').resolve()}\n  plot: {(out / 'plan.png').resolve()}")
    return 0


# ---- end plan --------------------------------------------------------------------------------------------------


def train(config: str, overrides: list[str]) -> int:
    started = time.perf_counter()
    trainer = build_trainer(config, overrides)
    trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    out = Path(trainer.args.output_dir)
    trainer.save_model(str(out))
    if trainer.is_world_process_zero():
        minutes = (time.perf_counter() - started) / 60
        print(f"\nFoRA training done in {minutes:.1f} min.")
        print(f"  adapter (plain PEFT LoRA): {out.resolve()}")
        if (out / SCORES_FILE).exists():
            print(f"  layer scores:              {(out / SCORES_FILE).resolve()}")
            print(f"  score plot:                {(out / SCORES_PLOT).resolve()}")
    return 0


def score(config: str, overrides: list[str]) -> int:
    trainer = build_trainer(config, overrides, score_only=True)
    if trainer.is_world_process_zero():
        out = Path(trainer.args.output_dir)
        # The selection is this command's output (`fora train` writes it when training ends).
        write_selection(trainer.fora_selection, out, table=False)
        print(f"\n  layer scores: {(out / SCORES_FILE).resolve()}\n  score plot:   {(out / SCORES_PLOT).resolve()}")
    return 0


def _check_files(*flags: tuple[str, str | None]) -> None:
    """Refuse a command-line file that does not exist before any model is loaded."""
    for flag, value in flags:
        if value is not None and not Path(value).is_file():
            raise FoRAInputError(f"{flag} {value} is not a file: give the path of an existing file.")


# `fora eval` flags that apply to one evaluation only: flag -> (its dest, the flag that asks for that evaluation).
_EVAL_FLAG_NEEDS = {
    "--tasks": ("tasks", "--commonsense-dir"),
    "--max-examples": ("max_examples", "--commonsense-dir"),
    "--max-new-tokens": ("max_new_tokens", "--commonsense-dir"),
    "--batch-size": ("batch_size", "--commonsense-dir"),
    "--ppl-max-length": ("ppl_max_length", "--wikitext"),
    "--ppl-stride": ("ppl_stride", "--wikitext"),
    "--ppl-max-tokens": ("ppl_max_tokens", "--wikitext"),
    "--model-id": ("model_id", "--mt-bench"),
}
_ASKED = {"--commonsense-dir": "commonsense_dir", "--wikitext": "wikitext", "--mt-bench": "mt_bench_questions"}


def _check_eval_flags_apply(args: argparse.Namespace) -> None:
    """Refuse a flag set to another value than its default for an evaluation that is not asked for (``--ppl-stride``
    without ``--wikitext``): it would be ignored without a word."""
    defaults = vars(build_parser().parse_args(["eval", "--base", "-"]))
    for flag, (dest, needed) in _EVAL_FLAG_NEEDS.items():
        if getattr(args, dest) != defaults[dest] and getattr(args, _ASKED[needed]) is None:
            refuse(
                flag,
                getattr(args, dest),
                f"it applies with {needed} only, which is not given",
                f"Add {needed}, or drop {flag}.",
            )


def _check_eval_output(out: Path) -> None:
    """Refuse an ``--output`` whose results.json another command wrote (an ablation run's): it would be replaced."""
    earlier = out / "results.json"
    if earlier.is_file():
        written = read_json(earlier, key="--output results.json")
        if not (isinstance(written, dict) and "base" in written):
            refuse(
                "--output",
                str(out),
                "it holds a results.json that `fora eval` did not write (an ablation run's, or another command's), "
                "which this run would replace",
                "Give another --output folder.",
            )


def _keep_earlier_results(out: Path) -> list[Path]:
    """Move an earlier `fora eval`'s results.json and results.md in ``out`` to results.<n>.json/.md (the first
    number free for both), so that a second evaluation into one folder (another task, another adapter, the MT-Bench
    comparison's next model) does not replace the first one's; returns the new names."""
    earlier = [f for f in (out / "results.json", out / "results.md") if f.is_file()]
    if not earlier:
        return []
    n = 1
    while any((out / f"results.{n}{f.suffix}").exists() for f in earlier):
        n += 1
    return [f.rename(out / f"results.{n}{f.suffix}") for f in earlier]


def check_eval_arguments(args: argparse.Namespace) -> None:
    """The numbers of ``fora eval``'s flags."""
    for flag in ("--max-examples", "--batch-size", "--max-new-tokens", "--ppl-max-length", "--ppl-stride"):
        check_number(flag, getattr(args, flag[2:].replace("-", "_")))
    check_number("--ppl-max-tokens", args.ppl_max_tokens)
    if args.ppl_stride > args.ppl_max_length:
        refuse(
            "--ppl-stride",
            args.ppl_stride,
            f"the stride must be at most --ppl-max-length ({args.ppl_max_length}), or tokens between windows are "
            "never scored",
            "Use e.g. --ppl-stride 512 with --ppl-max-length 1024.",
        )


def _check_eval_inputs(args: argparse.Namespace) -> dict[str, list]:
    """Everything `fora eval` is given, checked before the model loads; returns each commonsense task's examples
    (read, UTF-8 and valid JSON, here)."""
    check_eval_arguments(args)
    _check_eval_flags_apply(args)
    _check_files(("--wikitext", args.wikitext), ("--mt-bench", args.mt_bench_questions or None))
    check_output_folder(args.output, "--output")
    _check_eval_output(Path(args.output))
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    examples = {}
    if args.commonsense_dir:
        if not tasks:
            refuse("--tasks", args.tasks, "name at least one task", "E.g. --tasks boolq,ARC-Easy.")
        twice = sorted({t for t in tasks if tasks.count(t) > 1})
        if twice:
            refuse(
                "--tasks",
                args.tasks,
                f"{twice[0]!r} is named twice, and each task is one result",
                f"Name each task once: --tasks {','.join(dict.fromkeys(tasks))}.",
            )
        if not Path(args.commonsense_dir).is_dir():
            refuse(
                "--commonsense-dir", args.commonsense_dir, "it is not a folder", "Give the folder of <task>/test.json."
            )
        for task in tasks:
            if not Path(args.commonsense_dir, task, "test.json").is_file():
                raise FoRAInputError(f"--commonsense-dir {args.commonsense_dir} has no {task}/test.json.")
        for task in tasks:
            file = Path(args.commonsense_dir, task, "test.json")
            examples[task] = check_commonsense_examples(task, read_json(file), str(file))[: args.max_examples]
    if args.wikitext:
        check_nonblank_text(args.wikitext, "--wikitext")
    if args.adapter:
        check_adapter_folder(args.adapter, "--adapter")
    check_model(args.base, "--base")  # as every command checks its model: folder, weights, config
    return examples


def evaluate(args: argparse.Namespace) -> int:
    mt_bench_asked = args.mt_bench_questions is not None
    if not (args.commonsense_dir or args.wikitext or mt_bench_asked or args.lm_eval):
        raise FoRAInputError(
            "fora eval has nothing to do: give --commonsense-dir, --wikitext, --mt-bench or --lm-eval."
        )
    mt_bench.check_args(args)
    task_examples = _check_eval_inputs(args)
    out = Path(args.output)
    # Questions, compared answers, references, key and judge server are checked before the model is loaded and
    # anything generated.
    prepared = (
        mt_bench.prepare(mt_bench.config_from_args(args), out, args.mt_bench_compare) if mt_bench_asked else None
    )
    if args.lm_eval:
        print(lm_eval_command(args.base, args.adapter, ["boolq", "arc_easy", "arc_challenge", "openbookqa"]))
        if not (args.commonsense_dir or args.wikitext or mt_bench_asked):
            return 0
    model, tokenizer = load_model(args.base, args.adapter)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"base": args.base, "adapter": args.adapter}
    rows = ["| metric | value |", "|---|---:|"]
    if args.commonsense_dir:
        accuracies = []
        for task, examples in task_examples.items():
            result = commonsense_accuracy(
                model, tokenizer, examples, task, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size
            )
            results.setdefault("commonsense", {})[task] = result
            accuracies.append(result["accuracy"])
            rows.append(
                f"| {task} accuracy (n={result['total']}, misses {result['misses']}) | "
                f"{100 * result['accuracy']:.1f} |"
            )
        rows.append(f"| mean accuracy | {100 * sum(accuracies) / len(accuracies):.1f} |")
    if args.wikitext:
        results["perplexity"] = perplexity(
            model,
            tokenizer,
            check_text_file(args.wikitext, "--wikitext"),
            max_length=args.ppl_max_length,
            stride=args.ppl_stride,
            max_tokens=args.ppl_max_tokens,
            name=f"--wikitext {args.wikitext}",
        )
        rows.append(
            f"| perplexity ({results['perplexity']['tokens']} tokens) | {results['perplexity']['perplexity']:.2f} |"
        )
    extra = ""
    if prepared is not None:
        config = prepared.config
        source = {
            "base": args.base,
            "adapter": str(Path(args.adapter).resolve()) if args.adapter else None,
            "max_new_tokens": config.max_new_tokens,
            "chat_template": config.chat_template,
        }
        result = mt_bench.run(
            prepared,
            model,
            tokenizer,
            out,
            args.model_id,
            source,
            compare=args.mt_bench_compare,
            pairwise=args.mt_bench_pairwise,
        )
        results["mt_bench"] = {k: v for k, v in result.items() if k != "markdown"}
        if "summary" in result:
            own = result["summary"][args.model_id]
            score = mt_bench.format_score(own["score"])
            rows.append(f"| MT-Bench, judge {own['judge']} ({own['unparsable']} unparsable) | {score} |")
            extra = "\n## MT-Bench\n\n" + result["markdown"] + "\n"
        else:
            print(
                f"MT-Bench answers: {result['answers']}\nJudge them here with --judge-model (any OpenAI-compatible "
                f"server), or with FastChat (needs your OPENAI_API_KEY):\n  {mt_bench_judge_command(args.model_id)}"
            )
    kept = _keep_earlier_results(out)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text("\n".join(rows) + "\n" + extra)
    if kept:
        print(f"The earlier results in {out} are kept as {', '.join(p.name for p in kept)}.")
    print("\n".join(rows) + "\n" + extra)
    if extra:
        print(f"MT-Bench plot: {(out / 'mt_bench.png').resolve()}")
    print(f"\nresults: {(out / 'results.json').resolve()}")
    return 0


def _report_labels(adapters: list[str]) -> list[str]:
    """One label per adapter folder, as the report's rows and report.json's keys: the folder's name, with as many of
    its parent folders as keep two labels apart (two runs' ``checkpoint-500``); the same folder twice is refused."""
    paths = [Path(a).resolve() for a in adapters]
    again = next((a for a, p in zip(adapters, paths) if paths.count(p) > 1), None)
    if again is not None:
        refuse(
            "--vs", again, "this adapter folder is given twice (or is the adapter itself)", "Give each folder once."
        )
    depth = 1
    while True:
        labels = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
        depth += 1


def report(args: argparse.Namespace) -> int:
    _check_files(("--kl-text", args.kl_text))
    check_number("--kl-max-tokens", args.kl_max_tokens)
    if args.kl_text and not args.base:
        raise FoRAInputError("--kl-text needs --base: KL(p_trained || p_base) compares with the base model.")
    defaults = vars(build_parser().parse_args(["report", "-"]))
    for flag, value, unused in (
        ("--base", args.base, args.base is not None),
        ("--kl-max-tokens", args.kl_max_tokens, args.kl_max_tokens != defaults["kl_max_tokens"]),
    ):
        if unused and not args.kl_text:
            refuse(
                flag,
                value,
                "it is used for the KL on --kl-text only, which is not given",
                f"Add --kl-text FILE, or drop {flag}.",
            )
    adapters = [args.adapter, *args.vs]
    labels = _report_labels(adapters)
    reports = {label: adapter_report(a) for label, a in zip(labels, adapters)}
    out = Path(args.output or args.adapter)
    check_output_folder(out, "--output")
    if args.kl_text:
        check_nonblank_text(args.kl_text, "--kl-text")
        check_model(args.base, "--base")
    out.mkdir(parents=True, exist_ok=True)
    kl = None
    if args.kl_text:
        text = check_text_file(args.kl_text, "--kl-text")
        kl = {}
        for label, adapter in zip(labels, adapters):
            model, tokenizer = load_model(args.base, adapter)
            kl[label] = kl_to_base(model, tokenizer, text, max_tokens=args.kl_max_tokens)
    plot_spectra(out / "spectra.png", reports)
    saved = reports[labels[0]]["fora_scores"]
    selection = FoRASelection.from_dict(saved, args.adapter) if saved else None
    if selection is not None:
        scores = selection.scores.scores if selection.scores else None
        plot_fisher_scores(out / "fisher_scores.png", scores, selection.chosen, selection.num_layers)
    summary = markdown_summary(reports, kl)
    (out / "report.md").write_text(summary + "\n")
    payload = {label: dict(rep) for label, rep in reports.items()}
    if kl:
        for label, value in kl.items():
            payload[label]["kl_to_base"] = value
    (out / "report.json").write_text(json.dumps(payload, indent=2))
    print(summary)
    print(f"\nreport: {(out / 'report.md').resolve()}\nspectra: {(out / 'spectra.png').resolve()}")
    if selection is not None:
        print(f"fisher scores: {(out / 'fisher_scores.png').resolve()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    quiet_third_party_noise()
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    if args.command is None:
        if overrides:
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        parser.print_help()
        return 0
    if args.command in ("eval", "report") and overrides:
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    logging.basicConfig(format="%(message)s", level=logging.INFO)
    try:
        if args.command == "eval":
            return evaluate(args)
        if args.command == "report":
            return report(args)
        if args.command == "plan":
            return plan_command(args, overrides)
        if args.command == "ablate":
            run_ablation(args.config, overrides)
            return 0
        return {"train": train, "score": score}[args.command](args.config, overrides)
    except (FoRAInputError, OSError) as error:
        # Bad input, or a path the operating system refuses: what and how to fix it, on one line, no traceback.
        refusal = error if isinstance(error, FoRAInputError) else path_refusal(error)
        if refusal is None:
            raise
        message = " ".join(line.strip() for line in str(refusal).splitlines() if line.strip())
        print(f"fora {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
