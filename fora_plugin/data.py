"""Training data for `fora train`: a local JSON/JSONL file or a `datasets` name, with Alpaca rows made TRL-ready.

Alpaca rows (`instruction`, `input`, `output`) become prompt/completion pairs in the Stanford Alpaca template.
TRL's `SFTTrainer` trains such datasets with the loss on the completion only (its default
`completion_only_loss`), so the model learns the responses, not the instructions.
"""

from __future__ import annotations

import json
from pathlib import Path

from datasets import Dataset, load_dataset
from datasets.exceptions import DatasetGenerationError

from .validation import check_completions, check_json_rows_file


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
    Alpaca-format rows are converted with `alpaca_to_prompt_completion`; other datasets are returned unchanged.
    """
    local = _find_local(name_or_path, base_dir)
    if local is None:
        dataset = _load_hub_dataset(name_or_path, config_name, split)
    else:
        if config_name is not None:
            raise ValueError(
                f"config_name={config_name!r} was given for the local dataset {str(local)!r}, but only hub "
                "datasets have configs. Remove config_name."
            )
        if split != "train":
            raise ValueError(
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
            if problem is None:
                raise
            raise ValueError(f"{problem}. Fix the file: one JSON array of rows, or one row per line.") from error

    where = str(local) if local is not None else f"dataset {name_or_path!r} (split {split!r})"
    check_columns(dataset.column_names, where)
    if len(dataset) == 0:
        raise ValueError(f"{where} has no rows: give a dataset with training examples.")
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
        raise ValueError(
            f"dataset_name={name!r} is neither a local file or folder nor a dataset the hub could give "
            f"({type(error).__name__}: {error}). Give the path of a local .json/.jsonl file (relative paths are "
            "looked up in the current directory, then next to the config), or a hub dataset name on a machine with "
            "network access (or in the `datasets` cache)."
        ) from error


def check_columns(columns: list[str], where: str) -> None:
    """Refuse rows in none of the formats of ``ACCEPTED_FORMATS``, naming the columns found and those accepted."""
    if any(set(needed) <= set(columns) for needed, _ in ACCEPTED_FORMATS):
        return
    accepted = "; ".join(f"{' + '.join(needed)} ({what})" for needed, what in ACCEPTED_FORMATS)
    raise ValueError(
        f"{where} has rows with columns {sorted(columns)}, which is none of the accepted formats: {accepted}. "
        "Rename the columns (e.g. question -> instruction, answer -> output)."
    )


def read_json(path: str | Path, *, lines: bool = False):
    """The JSON document in ``path`` (with ``lines``: the list of one document per non-empty line); a malformed file
    is refused naming the file, the line and the column."""
    text = Path(path).read_text(encoding="utf-8")
    chunks = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()] if lines else [(1, text)]
    documents = []
    for first_line, chunk in chunks:
        try:
            documents.append(json.loads(chunk))
        except json.JSONDecodeError as error:
            line = first_line + error.lineno - 1
            raise ValueError(
                f"{path} is not valid JSON{' Lines' if lines else ''}: {error.msg} at line {line}, column "
                f"{error.colno}. Fix the file there."
            ) from None
    return documents if lines else documents[0]


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
                    return f"{file} is not valid JSON Lines: {error.msg} at line {number}, column {error.colno}"
                return f"{file} is not valid JSON: {whole.msg} at line {whole.lineno}, column {whole.colno}"
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
        raise ValueError(
            f"Dataset file {name_or_path!r} not found; tried {', '.join(str(p) for p in tried)}. "
            "Relative paths are looked up in the current directory, then next to the config file."
        )
    return None


def _json_files(local: Path) -> list[str]:
    files = [local] if local.is_file() else sorted(p for p in local.iterdir() if p.suffix in _JSON_SUFFIXES)
    if not files or files[0].suffix not in _JSON_SUFFIXES:
        raise ValueError(
            f"Local dataset {str(local)!r} is not a .json/.jsonl file or a folder holding some. Convert it to "
            "JSON/JSONL, or give a `datasets` hub name."
        )
    return [str(p) for p in files]
