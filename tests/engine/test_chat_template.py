"""Chat templates: a checkpoint's own Jinja template (in either place HF stores it), or the plain default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.prompting.chat_template import ChatTemplate, ChatTemplateError
from engine.protocol import ChatMessage

MESSAGES = [ChatMessage(role="system", content="Be brief."),
            ChatMessage(role="user", content=[{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}])]
# The shape of real templates: a BOS, role markers, raise_exception, and the generation prompt.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'assistant' and loop.first %}{{ raise_exception('the first turn must not be the model') }}"
    "{% endif %}[{{ m.role | upper }}] {{ m.content }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)


def write_config(directory: Path, **config: object) -> Path:
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_default_template_marks_roles_and_opens_the_answer(tmp_path: Path) -> None:
    text = ChatTemplate.for_model(str(tmp_path)).render(MESSAGES)
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"


def test_checkpoint_template_from_tokenizer_config(tmp_path: Path) -> None:
    write_config(tmp_path, chat_template=TEMPLATE, bos_token="<s>",
                 eos_token={"content": "</s>", "lstrip": False})  # AddedToken form
    text = ChatTemplate.for_model(str(tmp_path)).render(MESSAGES)
    assert text == "<s>[SYSTEM] Be brief.</s>\n[USER] Hi there</s>\n[ASSISTANT] "


def test_named_templates_use_default_and_jinja_file_is_a_fallback(tmp_path: Path) -> None:
    write_config(tmp_path, chat_template=[{"name": "tool_use", "template": "tools"},
                                          {"name": "default", "template": "{{ messages | length }}"}])
    assert ChatTemplate.for_model(str(tmp_path)).render(MESSAGES) == "2"
    write_config(tmp_path, bos_token="<s>")
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0].content | tojson }}")
    assert ChatTemplate.for_model(str(tmp_path)).render(MESSAGES) == '<s>"Be brief."'


def test_a_refusing_template_is_a_bad_request(tmp_path: Path) -> None:
    write_config(tmp_path, chat_template=TEMPLATE)
    with pytest.raises(ChatTemplateError, match=r"^messages: .*first turn must not be the model"):
        ChatTemplate.for_model(str(tmp_path)).render([ChatMessage(role="assistant", content="hello")])


def test_templates_run_sandboxed(tmp_path: Path) -> None:
    write_config(tmp_path, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        ChatTemplate.for_model(str(tmp_path)).render(MESSAGES)
