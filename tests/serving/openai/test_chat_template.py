"""``ChatTemplate``: the checkpoint's Jinja2 template when it has one, the documented plain template otherwise."""

from __future__ import annotations

import json

import pytest

from dflash_trt.errors import CheckpointFormatError
from dflash_trt.serving.openai.chat_template import ChatTemplate
from dflash_trt.serving.openai.protocol import ChatMessage, RequestRefused

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _messages(*pairs: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in pairs]


def test_plain_template_joins_contents_without_role_markers(tmp_path):
    template = ChatTemplate.for_checkpoint([tmp_path])
    assert template.origin == "plain"
    assert template.render(_messages(("user", "Once upon a time"))) == "Once upon a time"
    assert template.render(_messages(("system", "A story."), ("user", "Lily"))) == "A story.\nLily"


def test_tokenizer_config_chat_template_is_rendered_with_a_generation_prompt(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    template = ChatTemplate.for_checkpoint([tmp_path])
    assert template.origin == str(tmp_path / "tokenizer_config.json")
    rendered = template.render(_messages(("user", "hi")))
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_raises_refuses_the_request(tmp_path):
    source = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be the user') }}{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
    with pytest.raises(RequestRefused, match="first message must be the user"):
        ChatTemplate.for_checkpoint([tmp_path]).render(_messages(("assistant", "hi")))


def test_a_broken_template_is_refused_at_load(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(CheckpointFormatError, match="does not parse as Jinja2"):
        ChatTemplate.for_checkpoint([tmp_path])
