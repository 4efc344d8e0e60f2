"""fora_plugin.files: the text and JSON readers name the file, line and column of a mistake; a Jinja chat template
compiled up front accepts what transformers compiles and refuses, naming where it comes from and the line, what it
cannot; an output folder is tried, not guessed."""

import json
import os

import pytest

from fora_plugin.files import (
    check_chat_template,
    check_output_folder,
    json_error_position,
    read_chat_template,
    read_json,
)


TEMPLATES = [
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}",
    "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}",
    "{{ raise_exception('no') if messages | length == 0 }}{{ messages | tojson }}{{ strftime_now('%Y') }}",
    "{% for m in messages %}{{ m['content'] }}",  # unclosed for
    "{% if messages %}x{% endfor %}",  # wrong end tag
    "{{ messages[0] }",  # unclosed expression
    "{% generation %}x",  # unclosed generation block
    "{% continue %}",  # a loop control outside a loop: compiles in Jinja, fails when rendered
]


@pytest.mark.parametrize("template", TEMPLATES)
def test_templates_compile_here_as_they_compile_in_transformers(template):
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
        compiles = True
    except Exception:  # noqa: BLE001 (the reference: whether transformers compiles it)
        compiles = False
    if compiles:
        assert check_chat_template(template, "t") == template
    else:
        with pytest.raises(ValueError, match=r"^t is not a valid Jinja template: .*\. Fix the template there\.$"):
            check_chat_template(template, "t")


def test_a_template_file_is_read_as_utf8_and_compiled_naming_the_key_and_file(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text("{% for m in messages %}\n{{ m['content'] }}\n{% endif %}\n")
    with pytest.raises(ValueError, match=r"--mt-bench-chat-template .*chat\.jinja is not a valid Jinja .*\(line 3\)"):
        read_chat_template(path, "--mt-bench-chat-template")
    path.write_bytes("{{ 'caf\u00e9' }}".encode("latin-1"))
    with pytest.raises(ValueError, match=r"the file is not UTF-8 text"):
        read_chat_template(path, "--mt-bench-chat-template")
    with pytest.raises(ValueError, match=r"^t is a dict, not a Jinja template"):
        check_chat_template({"default": "x"}, "t")


def test_output_folder_is_tried_not_guessed(tmp_path):
    check_output_folder(tmp_path / "new" / "deeper", "output_dir")
    assert not (tmp_path / "new").exists()  # checking creates nothing
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"output_dir='.*file' is a file"):
        check_output_folder(tmp_path / "file", "output_dir")
    with pytest.raises(ValueError, match=r"no folder can be made under it"):
        check_output_folder(tmp_path / "file" / "out", "output_dir")
    if os.geteuid() != 0:  # root writes through permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        with pytest.raises(ValueError, match=r"is not writable"):
            check_output_folder(locked / "out", "output_dir")
    with pytest.raises(ValueError, match=r"/proc is not writable"):
        check_output_folder("/proc/fora-out", "output_dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] + (["locked"] if os.geteuid() != 0 else [])


def test_json_errors_say_where_once():
    with pytest.raises(json.JSONDecodeError) as info:
        json.loads('{"a": "b')
    assert json_error_position(info.value) == "Unterminated string starting at line 1, column 7"
    with pytest.raises(json.JSONDecodeError) as info:
        json.loads('{"a": 1,\n "b" 2}')
    assert json_error_position(info.value, first_line=5) == "Expecting ':' delimiter at line 6, column 6"


def test_read_json_names_the_file_and_line_of_a_mistake(tmp_path):
    good = tmp_path / "q.jsonl"
    good.write_text('{"a": 1}\n\n{"a": 2}\n')
    assert read_json(good, lines=True) == [{"a": 1}, {"a": 2}]
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n\n{"a": }\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl is not valid JSON Lines: .* at line 3, column 7"):
        read_json(tmp_path / "bad.jsonl", lines=True)
    (tmp_path / "bad.json").write_text('[\n  {"a": 1},\n  {"a" 2}\n]')
    with pytest.raises(ValueError, match=r"bad\.json is not valid JSON: .* at line 3, column 8"):
        read_json(tmp_path / "bad.json")
