"""Chat messages to prompt text: the checkpoint's own Jinja template when it ships one, else a plain one.

A Hugging Face checkpoint keeps its template in ``tokenizer_config.json`` (``chat_template``: a string, or a
list of named templates of which ``default`` is used) or, in newer exports, in ``chat_template.jinja``. It is
rendered the way ``transformers`` renders it: a sandboxed environment with ``trim_blocks``/``lstrip_blocks``,
``messages``, ``add_generation_prompt=True``, ``bos_token``, ``eos_token`` and ``raise_exception``.

The built-in ``tiny`` model, and any checkpoint without a template, get ``DEFAULT_TEMPLATE``::

    <|system|>
    You are terse.
    <|user|>
    Hi
    <|assistant|>

The rendered text spells out its special tokens, so it is tokenized without the tokenizer adding its own.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.protocol import ChatMessage

DEFAULT_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (e.g. roles that do not alternate) or failed to render."""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson  # jinja's own escapes HTML, which would corrupt a prompt
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token  # what rebuilds it elsewhere

    @classmethod
    def for_model(cls, model: str) -> ChatTemplate:
        """The template of ``model`` (a local checkpoint directory), or the default one."""
        directory = Path(model)
        config: dict[str, Any] = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
            source = named.get("default")
        jinja_path = directory / "chat_template.jinja"
        if source is None and jinja_path.is_file():
            source = jinja_path.read_text(encoding="utf-8")
        if not isinstance(source, str):
            return cls(DEFAULT_TEMPLATE)
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list[ChatMessage]) -> str:
        conversation = [
            {"role": m.role, "content": m.text, **({"name": m.name} if m.name is not None else {})}
            for m in messages
        ]
        try:
            return self._template.render(messages=conversation, add_generation_prompt=True,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as exc:
            raise ChatTemplateError(f"messages: the model's chat template rejected them: {exc}") from None


def _token_text(token: object) -> str:
    """A special token as ``tokenizer_config.json`` stores it: a string or an ``AddedToken`` dict."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise(message: str) -> None:
    raise TemplateError(message)
