"""load_train_dataset on local JSON/JSONL files, save_to_disk folders and the bundled Alpaca sample; the Alpaca
templates verbatim; the columns' types and the conversations' chat template checked before the model loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import char_tokenizer
from datasets import Dataset, DatasetDict

from fora_plugin.data import alpaca_to_prompt_completion, check_chat_rows, check_completions, load_train_dataset


EXAMPLE_CONFIGS = Path(__file__).resolve().parents[1] / "example_configs"

ROWS = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
]


def write_json(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps(rows))
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_alpaca_template_with_input():
    assert alpaca_to_prompt_completion(ROWS[0]) == {
        "prompt": "Below is an instruction that describes a task, paired with an input that provides further "
        "context. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n",
        "completion": "5",
    }


@pytest.mark.parametrize("row", [ROWS[1], {"instruction": "Name a colour.", "output": "Blue."}])
def test_alpaca_template_without_input(row):
    assert alpaca_to_prompt_completion(row) == {
        "prompt": "Below is an instruction that describes a task. Write a response that appropriately completes "
        "the request.\n\n### Instruction:\nName a colour.\n\n### Response:\n",
        "completion": "Blue.",
    }


@pytest.mark.parametrize("writer, name", [(write_json, "rows.json"), (write_jsonl, "rows.jsonl")])
def test_local_alpaca_file_becomes_prompt_completion(tmp_path, writer, name):
    dataset = load_train_dataset(str(writer(tmp_path / name, ROWS)))
    assert dataset.column_names == ["prompt", "completion"]
    assert dataset.to_list() == [alpaca_to_prompt_completion(row) for row in ROWS]


def test_folder_of_jsonl_files(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS[:1])
    write_jsonl(tmp_path / "b.jsonl", ROWS[1:])
    (tmp_path / "notes.txt").write_text("not data")
    dataset = load_train_dataset(str(tmp_path))
    assert sorted(dataset["completion"]) == ["5", "Blue."]


def test_relative_path_falls_back_to_base_dir(tmp_path, monkeypatch):
    config_dir = tmp_path / "configs"
    (config_dir / "data").mkdir(parents=True)
    write_json(config_dir / "data" / "rows.json", ROWS)
    monkeypatch.chdir(tmp_path)  # "data/rows.json" is not under the current directory
    dataset = load_train_dataset("data/rows.json", base_dir=config_dir)
    assert dataset["completion"] == ["5", "Blue."]


def test_relative_path_prefers_current_directory(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    write_json(tmp_path / "rows.json", ROWS[:1])
    write_json(tmp_path / "configs" / "rows.json", ROWS)
    monkeypatch.chdir(tmp_path)
    assert load_train_dataset("rows.json", base_dir=tmp_path / "configs")["completion"] == ["5"]


@pytest.mark.parametrize(
    "rows",
    [
        [{"prompt": "2+3=", "completion": "5"}],
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}],
        [{"text": "plain language-modelling text"}],
        # Alpaca columns next to a ready SFT column: the dataset already says what to train on.
        [{"instruction": "Add.", "output": "5", "text": "2+3=5"}],
    ],
)
def test_non_alpaca_datasets_pass_through(tmp_path, rows):
    dataset = load_train_dataset(str(write_jsonl(tmp_path / "rows.jsonl", rows)))
    assert dataset.to_list() == rows


def test_missing_file_names_the_paths_tried(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config_dir = tmp_path / "configs"
    with pytest.raises(ValueError, match=r"'data/missing\.json' not found; tried .*data/missing\.json, .*configs"):
        load_train_dataset("data/missing.json", base_dir=config_dir)


def test_missing_absolute_path(tmp_path):
    with pytest.raises(ValueError, match="not found; tried"):
        load_train_dataset(str(tmp_path / "nowhere" / "rows.jsonl"))


def test_unknown_split_names_the_available_ones(tmp_path):
    path = write_json(tmp_path / "rows.json", ROWS)
    with pytest.raises(ValueError, match=r"split='test' .* only split is \['train'\]"):
        load_train_dataset(str(path), split="test")


def test_config_name_is_rejected_for_local_files(tmp_path):
    path = write_json(tmp_path / "rows.json", ROWS)
    with pytest.raises(ValueError, match="config_name='en' .* Remove config_name"):
        load_train_dataset(str(path), config_name="en")


@pytest.mark.parametrize("name", ["rows.csv", "folder"])
def test_non_json_local_data_is_rejected(tmp_path, name):
    if name == "folder":
        (tmp_path / name).mkdir()
        (tmp_path / name / "rows.csv").write_text("instruction,output\nAdd.,5\n")
    else:
        (tmp_path / name).write_text("instruction,output\nAdd.,5\n")
    with pytest.raises(ValueError, match=r"is not a \.json/\.jsonl file or a folder holding some"):
        load_train_dataset(str(tmp_path / name))


def test_bundled_alpaca_sample(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # found through base_dir, as `fora train example_configs/....yaml` finds it
    dataset = load_train_dataset("data/alpaca_en_demo.json", base_dir=EXAMPLE_CONFIGS)
    assert len(dataset) == 999
    assert dataset.column_names == ["prompt", "completion"]
    raw = json.loads((EXAMPLE_CONFIGS / "data" / "alpaca_en_demo.json").read_text())
    assert dataset[0] == alpaca_to_prompt_completion(raw[0])
    with_input = sum(bool(row["input"]) for row in raw)
    assert sum("### Input:\n" in prompt for prompt in dataset["prompt"]) == with_input > 0


def test_hub_names_go_to_datasets(monkeypatch):
    calls = []

    def fake_load_dataset(path, **kwargs):  # no network here: stands in for the hub
        calls.append((path, kwargs))
        return Dataset.from_list(ROWS)

    monkeypatch.setattr("fora_plugin.data.load_dataset", fake_load_dataset)
    dataset = load_train_dataset("tatsu-lab/alpaca", config_name="default", split="train[:2]")
    assert calls == [("tatsu-lab/alpaca", {"name": "default", "split": "train[:2]"})]
    assert dataset.column_names == ["prompt", "completion"]


@pytest.mark.parametrize(
    "rows",
    [[{"question": "2+3?", "answer": "5"}], [{"instruction": "Add.", "response": "5"}], [{"prompt": "2+3="}]],
)
def test_rows_in_no_accepted_format_name_the_file_the_columns_and_the_formats(tmp_path, rows):
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    columns = re.escape(str(sorted(rows[0])))
    with pytest.raises(ValueError, match=rf"qa\.jsonl has rows with columns {columns}.*instruction \+ output"):
        load_train_dataset(str(path))


def test_an_empty_file_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl"):
        load_train_dataset(str(path))


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("rows.json", '[{"instruction": "a", "output": "b"},\n {"instruction": "c" "output": "d"}]', "JSON"),
        ("rows.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": c}\n', "JSON Lines"),
    ],
)
def test_malformed_json_names_the_file_and_the_line(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    line = 3 if name.endswith("l") else 2
    with pytest.raises(ValueError, match=rf"{re.escape(name)} is not valid {message}: .* at line {line}, column"):
        load_train_dataset(str(tmp_path / name))


def test_a_file_that_is_not_utf8_is_refused_naming_it_and_the_line(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(
        '{"instruction": "a", "output": "b"}\n{"instruction": "caf\u00e9", "output": "c"}\n'.encode("latin-1")
    )
    with pytest.raises(
        ValueError, match=r"latin\.jsonl' is invalid: the file is not UTF-8 text \(byte 0xe9 on line 2"
    ):
        load_train_dataset(str(path))


@pytest.mark.parametrize("text", ["[]", "{}", "  \n\n"])
def test_a_file_without_rows_is_refused(tmp_path, text):
    path = tmp_path / "none.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"none\.json' is invalid: the file (holds .*, no rows|is empty)"):
        load_train_dataset(str(path))


def test_all_empty_completions_are_refused_and_some_are_warned_about(tmp_path):
    blank = write_json(tmp_path / "blank.json", [{**row, "output": " "} for row in ROWS])
    with pytest.raises(ValueError, match=r"blank\.json' is invalid: all 2 rows have an empty 'completion'"):
        load_train_dataset(str(blank))
    some = write_json(tmp_path / "some.json", [ROWS[0], {**ROWS[1], "output": ""}])
    with pytest.warns(UserWarning, match=r"some\.json: 1 of 2 rows have an empty 'completion'"):
        assert len(load_train_dataset(str(some))) == 2


def test_a_hub_name_that_cannot_be_reached_is_refused_by_name(monkeypatch):
    def offline_load_dataset(path, **kwargs):  # what `datasets` raises offline
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr("fora_plugin.data.load_dataset", offline_load_dataset)
    with pytest.raises(
        ValueError, match=r"dataset_name='org/nothing' is neither a local file or folder nor a dataset"
    ):
        load_train_dataset("org/nothing")


def test_rows_whose_prompt_fills_max_length_are_refused_all_or_warned_some():
    """TRL truncates to max_length from the start and drops a row left without a completion token."""
    from types import SimpleNamespace

    from conftest import char_tokenizer

    from fora_plugin.data import check_rows_fit

    rows = Dataset.from_list([{"prompt": "abcdef", "completion": "gh"}, {"prompt": "ab", "completion": "cd"}])
    args = SimpleNamespace(max_length=4, packing=False, truncation_mode="keep_start", completion_only_loss=None)
    with pytest.warns(UserWarning, match=r"d\.json: 1 of 2 rows have a prompt of at least max_length=4 tokens"):
        check_rows_fit(rows, char_tokenizer(), args, "d.json")
    with pytest.raises(ValueError, match=r"max_length=2 is invalid: every one of the 2 rows .*\(prompts are 2 to 6 "):
        check_rows_fit(rows, char_tokenizer(), SimpleNamespace(**{**vars(args), "max_length": 2}), "d.json")
    check_rows_fit(rows, char_tokenizer(), SimpleNamespace(**{**vars(args), "packing": True}), "d.json")  # TRL's


def test_a_save_to_disk_folder_is_loaded_as_datasets_saved_it(tmp_path):
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert load_train_dataset(str(tmp_path / "one")).to_list() == [alpaca_to_prompt_completion(r) for r in ROWS]
    with pytest.raises(ValueError, match=r"split='test' is not in the `save_to_disk` folder"):
        load_train_dataset(str(tmp_path / "one"), split="test")
    DatasetDict({"train": Dataset.from_list(ROWS), "dev": Dataset.from_list(ROWS[:1])}).save_to_disk(
        str(tmp_path / "two")
    )
    assert len(load_train_dataset(str(tmp_path / "two"), split="dev")) == 1
    with pytest.raises(
        ValueError, match=r"split='test' is invalid: the `save_to_disk` folder .* holds the splits \['dev', 'train'\]"
    ):
        load_train_dataset(str(tmp_path / "two"), split="test")
    with pytest.raises(
        ValueError, match=r"dataset_config='x' is invalid: .* a `save_to_disk` folder, which has no configs"
    ):
        load_train_dataset(str(tmp_path / "two"), config_name="x")


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [{"messages": "user: hi"}],
            r"its column 'messages' holds Value\('string'\) \(row 0: 'user: hi'\), not a list",
        ),
        (
            [{"messages": [{"from": "human", "value": "hi"}]}],
            r"its column 'messages' holds List\(.*\), not a list of .*ShareGPT's from/value keys: rename them",
        ),
        (
            [{"instruction": "a", "output": 3}],
            r"its column 'output' holds Value\('int64'\) \(row 0: 3\), not a string",
        ),
        (
            [{"prompt": 1, "completion": "b"}],
            r"its column 'prompt' holds Value\('int64'\) .*, not a string per row, or",
        ),
        ([{"text": ["a", "b"]}], r"its column 'text' holds List\(Value\('string'\)\)"),
    ],
)
def test_a_column_of_the_wrong_type_is_refused_naming_it_and_a_row(tmp_path, rows, message):
    with pytest.raises(ValueError, match=r"dataset_name='.*rows\.json' is invalid: " + message):
        load_train_dataset(str(write_json(tmp_path / "rows.json", rows)))


def test_columns_of_the_right_types_and_others_are_accepted(tmp_path):
    rows = [{**r, "id": i, "input": None, "meta": {"source": "x"}} for i, r in enumerate(ROWS)]
    assert len(load_train_dataset(str(write_json(tmp_path / "rows.json", rows)))) == 2
    chat = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    assert load_train_dataset(str(write_json(tmp_path / "chat.json", chat))).column_names == ["messages"]


def test_conversations_are_rendered_by_the_chat_template_before_the_model_loads():
    tokenizer = char_tokenizer()
    roles = "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    tokenizer.chat_template = (
        roles + "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    chat = [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]] * 3
    check_chat_rows(Dataset.from_list([{"messages": m} for m in chat]), tokenizer, "d.json", "m")
    prompts = Dataset.from_list([{"prompt": m[:1], "completion": m[1:]} for m in chat])
    check_chat_rows(prompts, tokenizer, "d.json", "m")  # conversational prompt/completion
    odd = [*chat, [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]]
    with pytest.raises(
        ValueError,
        match=r"row 3's conversation \(roles \['system', 'user'\]\) cannot be rendered .* \(TemplateError: "
        r"Unknown role: system\)\. Use roles",
    ):
        check_chat_rows(Dataset.from_list([{"messages": m} for m in odd]), tokenizer, "d.json", "m")
    tokenizer.chat_template = None
    with pytest.raises(
        ValueError, match=r"its rows are conversations \('messages'\), but the tokenizer of m has no chat template"
    ):
        check_chat_rows(Dataset.from_list([{"messages": m} for m in chat]), tokenizer, "d.json", "m")
    check_chat_rows(Dataset.from_list([{"text": "plain"}]), tokenizer, "d.json", "m")  # no conversation: nothing to do


def test_completions_all_empty_refused_some_empty_warned():
    with pytest.raises(ValueError, match=r"all 2 rows have an empty 'completion'"):
        check_completions(Dataset.from_list([{"prompt": "a", "completion": ""}] * 2), "d.json")
    with pytest.warns(UserWarning, match=r"1 of 2 rows have an empty 'text'"):
        check_completions(Dataset.from_list([{"text": "a"}, {"text": "  "}]), "d.json")
    messages = [{"role": "user", "content": "hi"}]
    check_completions(
        Dataset.from_list([{"prompt": messages, "completion": [{"role": "assistant", "content": "x"}]}]), "d"
    )
