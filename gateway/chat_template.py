"""Chat prompts rendered with the checkpoint's own chat template.

The template is ``chat_template`` of the checkpoint's ``tokenizer_config.json`` (a string, or a list of
named templates of which ``default`` is used), rendered as transformers' ``apply_chat_template`` does:
a sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the ``tojson`` filter, a
``raise_exception`` the template can call, and the variables ``messages``, ``add_generation_prompt``,
``bos_token`` and ``eos_token``. A checkpoint without one has no ChatTemplate (chat requests get a 400).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from specserve.errors import SpecserveError


class ChatTemplateError(SpecserveError):
    """The template cannot be read or compiled, or refused a conversation (its raise_exception)."""


def _token_text(value) -> str:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""
    _template: object = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # compiled once; a template that does not compile stops the gateway at start, not a request
        object.__setattr__(self, "_template", self._compile())

    def _compile(self):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ChatTemplateError(f"messages: the chat template refused them: {message}")

        def tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
            return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat_template does not compile: {exc}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (messages: [{"role": ..., "content": ...}, ...])."""
        import jinja2

        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"messages: the chat template failed on them: {exc}") from None


def load_chat_template(checkpoint: str | Path) -> ChatTemplate | None:
    """The checkpoint's chat template, or None when it has none: ``chat_template.jinja`` (where recent
    transformers saves it) else ``chat_template`` of tokenizer_config.json."""
    path = Path(checkpoint) / "tokenizer_config.json"
    config = {}
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ChatTemplateError(f"cannot read {path}: {exc}") from None
    jinja_file = Path(checkpoint) / "chat_template.jinja"
    source = jinja_file.read_text() if jinja_file.is_file() else config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not source:
        return None
    if not isinstance(source, str):
        raise ChatTemplateError(f"{path}: chat_template is neither a string nor named templates")
    return ChatTemplate(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))
