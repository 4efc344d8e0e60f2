"""Training data for `fora train`: a local JSON/JSONL file, a `save_to_disk` folder or a `datasets` name, its
columns' types and (conversations) their chat template checked; Alpaca rows made TRL-ready.

Alpaca rows (`instruction`, `input`, `output`) become prompt/completion pairs in the Stanford Alpaca template.
TRL's `SFTTrainer` trains such datasets with the loss on the completion only (its default
`completion_only_loss`), so the model learns the responses, not the instructions.

May import: errors, files.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from datasets.exceptions import DatasetGenerationError

from .errors import FoRAInputError, path_refusal, refuse
from .files import check_text_file, json_error_position


__all__ = [
    "alpaca_to_prompt_completion",
    "check_chat_rows",
    "check_column_types",
    "check_columns",
    "check_completions",
    "check_json_rows_file",
    "check_rows_fit",
    "load_train_dataset",
]


ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_COLUMNS = ("instruction", "input", "output")
# Columns of formats that SFTTrainer reads as they are: a dataset with one of them is not converted.
_SFT_COLUMNS = ("prompt", "messages", "text")
# The row formats `fora train` trains on, as (columns, what they are), for the messages.
ACCEPTED_FORMATS = (
    (("instruction", "output"), "Alpaca (`input` optional)"),
    (("prompt", "completion"), "prompt/completion"),
    (("messages",), "conversational"),
    (("text",), "plain text"),
)
_JSON_SUFFIXES = (".json", ".jsonl")
# What `Dataset.save_to_disk` / `DatasetDict.save_to_disk` write into their folder.
_SAVED_DATASET = ("state.json", "dataset_info.json")
_SAVED_DATASET_DICT = "dataset_dict.json"
# Columns of text, and columns that hold a conversation (a list of {role, content}) or, for prompt/completion, either.
_TEXT_COLUMNS = ("text", "instruction", "input", "output")
_CONVERSATION_COLUMNS = ("messages",)
_TEXT_OR_CONVERSATION_COLUMNS = ("prompt", "completion")


def alpaca_to_prompt_completion(row: dict) -> dict:
    """Turn one Alpaca row into `{"prompt", "completion"}`; an empty or missing `input` uses the no-input template."""
    if row.get("input"):
        prompt = ALPACA_PROMPT_WITH_INPUT.format(instruction=row["instruction"], input=row["input"])
    else:
        prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=row["instruction"])
    return {"prompt": prompt, "completion": row["output"]}


def load_train_dataset(
    name_or_path: str,
    *,
    config_name: str | None = None,
    split: str = "train",
    base_dir: str | Path | None = None,
) -> Dataset:
    """Load one split of a local `.json`/`.jsonl` file (or folder of them) or of a `datasets` hub dataset.

    A relative local path is looked up in the current directory, then in `base_dir` (the YAML config's folder).
    A folder that `save_to_disk` wrote is loaded with `datasets.load_from_disk`. Alpaca-format rows are converted with
    `alpaca_to_prompt_completion`; other datasets are returned unchanged.
    """
    try:
        local = _find_local(name_or_path, base_dir)
    except OSError as error:  # a name too long to be a path, a file where a folder must be
        raise (path_refusal(error, "dataset_name") or error) from None
    if local is None:
        dataset = _load_hub_dataset(name_or_path, config_name, split)
    elif local.is_dir() and _is_saved_dataset(local):
        dataset = _load_saved_dataset(local, config_name, split)
    else:
        if config_name is not None:
            raise FoRAInputError(
                f"config_name={config_name!r} was given for the local dataset {str(local)!r}, but only hub "
                "datasets have configs. Remove config_name."
            )
        if split != "train":
            raise FoRAInputError(
                f"split={split!r} is not in the local dataset {str(local)!r}, whose only split is ['train']. "
                "Use split: train, or point to a file holding that split."
            )
        files = _json_files(local)
        for file in files:  # UTF-8, not empty, not `[]`: before `datasets` reports them without the file's name
            check_json_rows_file(file, "dataset_name")
        try:
            dataset = load_dataset("json", data_files=files, split="train")
        except DatasetGenerationError as error:
            problem = _first_json_problem(files)
            if problem is not None:
                raise FoRAInputError(
                    f"{problem}. Fix the file: one JSON array of rows, or one row per line."
                ) from error
            # Valid JSON that the builder still cannot read (a column whose type changes from row to row): about
            # this file, which only this place names.
            cause = error.__cause__ or error
            refuse(
                "dataset_name",
                str(local),
                f"`datasets` cannot read it as a table ({type(cause).__name__}: {str(cause).splitlines()[0]})",
                "Give every row the same keys, each holding one type of value (e.g. every `output` a string).",
            )

    where = str(local) if local is not None else f"dataset {name_or_path!r} (split {split!r})"
    check_columns(dataset.column_names, where)
    check_column_types(dataset, where)
    if len(dataset) == 0:
        raise FoRAInputError(f"{where} has no rows: give a dataset with training examples.")
    columns = set(dataset.column_names)
    if {"instruction", "output"} <= columns and not columns & set(_SFT_COLUMNS):
        dataset = dataset.map(alpaca_to_prompt_completion, remove_columns=[c for c in ALPACA_COLUMNS if c in columns])
    check_completions(dataset, where)
    return dataset


def _load_hub_dataset(name: str, config_name: str | None, split: str) -> Dataset:
    """One split of a `datasets` hub dataset; a name the hub does not know, or cannot be asked about (offline), is
    refused by name."""
    from datasets.exceptions import DatasetNotFoundError

    try:
        return load_dataset(name, name=config_name, split=split)
    except (ConnectionError, DatasetNotFoundError) as error:
        raise FoRAInputError(
            f"dataset_name={name!r} is neither a local file or folder nor a dataset the hub could give "
            f"({type(error).__name__}: {error}). Give the path of a local .json/.jsonl file (relative paths are "
            "looked up in the current directory, then next to the config), or a hub dataset name on a machine with "
            "network access (or in the `datasets` cache)."
        ) from error
    except ImportError:  # a package the dataset's loader needs: the environment's to fix
        raise
    except Exception as error:  # what `datasets` raises for a name, config or split it has (ValueError, KeyError, ...)
        refuse(
            "dataset_name",
            name,
            f"`datasets` cannot load split {split!r}"
            + (f" of config {config_name!r}" if config_name else "")
            + f" ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})",
            "Check dataset_config and dataset_train_split / dataset_test_split against the dataset's card.",
        )


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / _SAVED_DATASET_DICT).is_file() or all((folder / name).is_file() for name in _SAVED_DATASET)


def _load_saved_dataset(folder: Path, config_name: str | None, split: str) -> Dataset:
    """One split of a folder that `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote."""
    if config_name is not None:
        refuse(
            "dataset_config",
            config_name,
            f"{folder} is a `save_to_disk` folder, which has no configs",
            "Remove dataset_config.",
        )
    try:
        saved = load_from_disk(str(folder))
    except Exception as error:  # datasets' errors for a damaged folder are of several types
        refuse(
            "dataset_name",
            str(folder),
            f"it looks like a `save_to_disk` folder, but `datasets.load_from_disk` cannot load it "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})",
            "Save the dataset again with save_to_disk, or give a .json/.jsonl file.",
        )
    if isinstance(saved, DatasetDict):
        if split not in saved:
            refuse(
                "split",
                split,
                f"the `save_to_disk` folder {folder} holds the splits {sorted(saved)}",
                "Name one of them (dataset_train_split / dataset_test_split).",
            )
        return saved[split]
    if split != "train":
        raise FoRAInputError(
            f"split={split!r} is not in the `save_to_disk` folder {str(folder)!r}, which holds one Dataset (used as "
            "the 'train' split). Use split: train, or save a DatasetDict with that split."
        )
    return saved


def check_columns(columns: list[str], where: str) -> None:
    """Refuse rows in none of the formats of ``ACCEPTED_FORMATS``, naming the columns found and those accepted."""
    if any(set(needed) <= set(columns) for needed, _ in ACCEPTED_FORMATS):
        return
    accepted = "; ".join(f"{' + '.join(needed)} ({what})" for needed, what in ACCEPTED_FORMATS)
    raise FoRAInputError(
        f"{where} has rows with columns {sorted(columns)}, which is none of the accepted formats: {accepted}. "
        "Rename the columns (e.g. question -> instruction, answer -> output)."
    )


def _is_text(feature) -> bool:
    return getattr(feature, "dtype", None) in ("string", "large_string")


def _is_conversation(feature) -> bool:
    """A list (``List``, ``LargeList``, ``Sequence`` or a one-item list) of mappings with ``role`` and ``content``."""
    inner = feature[0] if isinstance(feature, list) and len(feature) == 1 else getattr(feature, "feature", None)
    return isinstance(inner, dict) and {"role", "content"} <= set(inner)


def check_column_types(dataset: Dataset, where: str, key: str = "dataset_name") -> None:
    """Refuse a column of a row format that holds the wrong kind of value in every row (``datasets`` gives each
    column one type): text columns hold strings, ``messages`` a list of ``{role, content}`` per row, prompt and
    completion either. TRL would drop such a column without a word and fail later, after the model loaded."""
    features = dataset.features
    for column, feature in features.items():
        if column in _TEXT_COLUMNS:
            ok = _is_text(feature) or (column == "input" and getattr(feature, "dtype", None) == "null")
            accepted = "a string per row"
        elif column in _CONVERSATION_COLUMNS:
            ok, accepted = _is_conversation(feature), 'a list of {"role": ..., "content": ...} messages per row'
        elif column in _TEXT_OR_CONVERSATION_COLUMNS:
            ok = _is_text(feature) or _is_conversation(feature)
            accepted = 'a string per row, or a list of {"role": ..., "content": ...} messages'
        else:
            continue  # other columns are not read
        if ok:
            continue
        example = repr(dataset[0][column]) if len(dataset) else "-"
        example = example if len(example) <= 60 else example[:57] + "..."
        fix = (
            'Give each row a list of messages, e.g. [{"role": "user", "content": "..."}, {"role": "assistant", '
            '"content": "..."}] (ShareGPT\'s from/value keys: rename them role/content), or name a column of whole '
            "texts `text`."
            if column in _CONVERSATION_COLUMNS + _TEXT_OR_CONVERSATION_COLUMNS
            else f"Make every row's {column} a string."
        )
        refuse(key, where, f"its column {column!r} holds {feature} (row 0: {example}), not {accepted}", fix)


def check_chat_rows(dataset: Dataset, tokenizer, where: str, model: str, key: str = "dataset_name") -> None:
    """Refuse conversational rows that the chat template cannot render, before the model loads: one row of each
    distinct sequence of roles is rendered as TRL renders it, and whatever the template raises (an unknown role,
    a missing system prompt) is named with the row."""
    column = next((c for c in ("messages", "prompt") if c in dataset.column_names), None)
    if column is None or not _is_conversation(dataset.features[column]):
        return
    if tokenizer.chat_template is None:
        refuse(
            key,
            where,
            f"its rows are conversations ({column!r}), but the tokenizer of {model} has no chat template for them",
            "Set chat_template_path to a .jinja template (or to a model with one), or give the rows as "
            "prompt/completion text.",
        )
    completions = dataset["completion"] if column == "prompt" and "completion" in dataset.column_names else None
    tools = dataset["tools"] if "tools" in dataset.column_names else None
    seen: set[tuple] = set()
    for index, conversation in enumerate(dataset[column]):
        conversation = list(conversation) + (list(completions[index]) if completions is not None else [])
        roles = tuple(str(m.get("role")) for m in conversation)
        if roles in seen:
            continue
        seen.add(roles)
        try:
            tokenizer.apply_chat_template(
                conversation, tools=tools[index] if tools is not None else None, tokenize=False
            )
        except Exception as error:  # a template raises what its author chose (TemplateError, TypeError, ...)
            sharegpt = {"human", "gpt"} & set(roles)
            fix = (
                "ShareGPT's roles: rename human -> user and gpt -> assistant."
                if sharegpt
                else "Use roles and fields this template takes, or set chat_template_path to a template for them."
            )
            refuse(
                key,
                where,
                f"row {index}'s conversation (roles {list(roles)}) cannot be rendered by the chat template of {model} "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})",
                fix,
            )


def _first_json_problem(files: list[str]) -> str | None:
    """Where the first malformed JSON is among ``files`` (file, line, column), or None if they all parse."""
    for file in files:
        text = Path(file).read_text(encoding="utf-8", errors="replace")
        try:
            json.loads(text)
            continue
        except json.JSONDecodeError as error:
            whole = error
        # Not one JSON document; it may still be JSON Lines, which `datasets` also reads from a .json file.
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as error:
                if Path(file).suffix == ".jsonl" or number > 1:
                    return f"{file} is not valid JSON Lines: {json_error_position(error, number)}"
                return f"{file} is not valid JSON: {json_error_position(whole)}"
    return None


def _find_local(name_or_path: str, base_dir: str | Path | None) -> Path | None:
    """The existing local file or folder `name_or_path` names, or None for a `datasets` name."""
    path = Path(name_or_path).expanduser()
    tried = [path] if path.is_absolute() else [Path.cwd() / path]
    if not path.is_absolute() and base_dir is not None:
        tried.append(Path(base_dir) / path)
    for candidate in tried:
        if candidate.exists():
            return candidate
    if path.suffix in _JSON_SUFFIXES or path.is_absolute():
        raise FoRAInputError(
            f"Dataset file {name_or_path!r} not found; tried {', '.join(str(p) for p in tried)}. "
            "Relative paths are looked up in the current directory, then next to the config file."
        )
    return None


def _json_files(local: Path) -> list[str]:
    files = [local] if local.is_file() else sorted(p for p in local.iterdir() if p.suffix in _JSON_SUFFIXES)
    if not files or files[0].suffix not in _JSON_SUFFIXES:
        raise FoRAInputError(
            f"Local dataset {str(local)!r} is not a .json/.jsonl file or a folder holding some. Convert it to "
            "JSON/JSONL, or give a `datasets` hub name."
        )
    return [str(p) for p in files]


def check_rows_fit(dataset: Dataset, tokenizer, args, where: str, key: str = "max_length") -> None:
    """Refuse prompt/completion rows that TRL would all drop: with the loss on completions only, truncation to
    ``max_length`` (from the start) keeps no completion token of a row whose prompt fills ``max_length``, and TRL
    removes such rows, leaving scoring an empty dataloader. Warns when it drops some. Needs the tokenizer only, so
    it runs before the model loads. Conversational prompts (chat templates) and packing are left to TRL."""
    max_length = args.max_length
    if (
        max_length is None
        or args.packing
        or getattr(args, "truncation_mode", "keep_start") != "keep_start"  # a TRL field of some releases only
        or args.completion_only_loss is False
        or not {"prompt", "completion"} <= set(dataset.column_names)
        or len(dataset) == 0
        or not isinstance(dataset[0]["prompt"], str)
    ):
        return
    prompts, completions = list(dataset["prompt"]), list(dataset["completion"])
    rows = tokenizer([p + c for p, c in zip(prompts, completions)])["input_ids"]
    prompts = tokenizer(prompts)["input_ids"]
    # TRL's completion starts where the two tokenizations diverge (its common_prefix_length).
    prompt_lengths = [
        next((i for i, (a, b) in enumerate(zip(p, r)) if a != b), min(len(p), len(r))) for p, r in zip(prompts, rows)
    ]
    dropped = sum(length >= max_length for length in prompt_lengths)
    row_lengths = [len(r) for r in rows]
    if dropped == len(rows):
        refuse(
            key,
            max_length,
            f"every one of the {len(rows)} rows of {where} has a prompt of at least {max_length} tokens (prompts are "
            f"{min(prompt_lengths)} to {max(prompt_lengths)} tokens, whole rows {min(row_lengths)} to "
            f"{max(row_lengths)}), so truncation leaves no completion token to learn and TRL drops every row",
            f"Raise max_length above the prompts: max_length: {max(row_lengths)} keeps every row whole (or shorten "
            "the prompts).",
        )
    if dropped:
        warnings.warn(
            f"{where}: {dropped} of {len(rows)} rows have a prompt of at least max_length={max_length} tokens; TRL "
            f"drops them (truncation leaves no completion token). max_length: {max(row_lengths)} keeps every row.",
            stacklevel=2,
        )


def check_json_rows_file(path: str | os.PathLike, key: str) -> None:
    """Refuse a local .json/.jsonl dataset file that is empty, not UTF-8, or holds no rows (``[]``)."""
    text = check_text_file(path, key)
    if not text.strip():
        refuse(key, str(path), "the file is empty", "Give a file with training rows.")
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return  # JSON Lines, or malformed: read and reported by the loader
    if document == [] or document == {}:
        refuse(key, str(path), f"the file holds {text.strip()!r}, no rows", "Give a file with training rows.")


def check_completions(dataset: Any, where: str, key: str = "dataset_name") -> None:
    """Refuse a dataset whose completions (or texts) are all empty; warn when some are.

    With an empty completion the loss is on the end-of-sequence token alone: the run would train the model to stop.
    """
    column = next((c for c in ("completion", "text") if c in dataset.column_names), None)
    if column is None:
        return
    empty = sum(1 for value in dataset[column] if not _has_content(value))
    if empty == len(dataset):
        refuse(
            key,
            where,
            f"all {len(dataset)} rows have an empty {column!r} (the `output` of Alpaca rows): training would teach "
            "the end-of-sequence token alone",
            "Fill in the responses, or point to the right file.",
        )
    if empty:
        warnings.warn(
            f"{where}: {empty} of {len(dataset)} rows have an empty {column!r}; they train the end-of-sequence "
            "token only. Remove them or fill in their responses.",
            stacklevel=2,
        )


def _has_content(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, list):  # conversational: a list of messages
        return any(_has_content(m.get("content") if isinstance(m, Mapping) else m) for m in value)
    return value is not None
