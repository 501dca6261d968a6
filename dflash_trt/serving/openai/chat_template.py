"""``ChatTemplate``: chat messages -> the prompt text the model was trained to continue.

A checkpoint whose ``tokenizer_config.json`` has a ``chat_template`` (a Jinja2 template, as Hugging Face
writes it) is rendered with it, ``add_generation_prompt=True``, in a sandboxed environment. ``bos_token``
renders empty because the tokenizer adds its own start token when it encodes the prompt (rendering it
too would start the prompt with two).

Without one (the embedded stories260K has none) the **plain template** applies: the messages' contents in
order, joined by one newline, with no role markers. A single user message is thus sent to the model
exactly as written, the same prompt as ``/v1/completions`` or ``dflash-trt run --prompt`` with that text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from dflash_trt.errors import CheckpointFormatError, DFlashError
from dflash_trt.serving.openai.protocol import ChatMessage, RequestRefused

PLAIN = "plain"


class ChatTemplate:
    def __init__(self, source: str | None, eos_token: str = "", origin: str = PLAIN) -> None:
        self.source, self.origin = source, origin
        self._template = None
        if source is not None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            try:
                environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                environment.globals["raise_exception"] = _raise_template_error
                self._template = environment.from_string(source)
            except TemplateError as exc:
                raise CheckpointFormatError(f"{origin}: `chat_template` does not parse as Jinja2 ({exc}); expected "
                                            "a Hugging Face chat template. Fix: correct it, or pass --chat-template "
                                            "plain.") from None
        self.eos_token = eos_token

    @classmethod
    def for_checkpoint(cls, folders: Sequence[Path], override: str | None = None) -> ChatTemplate:
        """``override`` (a template file, or ``plain``), else the first ``tokenizer_config.json`` with a
        ``chat_template`` in ``folders``, else the plain template."""
        if override == PLAIN:
            return cls(None)
        if override is not None:
            path = Path(override)
            if not path.is_file():
                raise CheckpointFormatError(f"--chat-template is {override!r}: no such file; expected a Jinja2 "
                                            "template file or `plain`. Fix: check the path.")
            return cls(path.read_text(encoding="utf-8"), origin=str(path))
        for folder in folders:
            config_path = folder / "tokenizer_config.json"
            if not config_path.is_file():
                continue
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise CheckpointFormatError(f"{config_path}: is not JSON ({exc}). Fix: restore the file from the "
                                            "checkpoint.") from None
            template = config.get("chat_template") if isinstance(config, dict) else None
            if isinstance(template, list):  # several named templates: the "default" one
                template = next((t.get("template") for t in template if t.get("name") == "default"), None)
            if isinstance(template, str):
                return cls(template, _token_text(config.get("eos_token")), str(config_path))
        return cls(None)

    def render(self, messages: Sequence[ChatMessage]) -> str:
        if self._template is None:
            return "\n".join(message.text for message in messages)
        conversation = [{"role": m.role, "content": m.text, **({"name": m.name} if m.name else {})}
                        for m in messages]
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=conversation, add_generation_prompt=True, bos_token="",
                                         eos_token=self.eos_token)
        except (TemplateRefusal, TemplateError) as exc:
            raise RequestRefused(f"the chat template refused these messages: {exc}. Fix: send the roles and order "
                                 "this model's template expects.", param="messages") from None


class TemplateRefusal(DFlashError, ValueError):
    """A chat template's own ``raise_exception`` (e.g. roles out of order)."""


def _raise_template_error(message: str) -> None:
    raise TemplateRefusal(message)


def _token_text(token: object) -> str:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""
