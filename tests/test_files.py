"""check_chat_template: a Jinja chat template compiled up front accepts what transformers compiles and refuses,
naming where it comes from and the line, what it cannot."""

import pytest

from fora_plugin.files import check_chat_template, read_chat_template


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
