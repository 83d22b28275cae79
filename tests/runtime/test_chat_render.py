"""Chat rendering options: no generation prompt, continuing the final message (cut where
its content ends, as transformers does), and the variables a template reads."""

from __future__ import annotations

import pytest

from sprig.runtime.server.chat_render import ChatRenderer
from sprig.runtime.tiny_checkpoint import CHAT_TEMPLATE

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the answer is "}]


def renderer(template: str = CHAT_TEMPLATE) -> ChatRenderer:
    return ChatRenderer(template, {}, max_chars=10_000)


def test_generation_prompt_and_continuation() -> None:
    r = renderer()
    opened = r.render(MESSAGES, None, None)
    closed = r.render(MESSAGES, None, None, add_generation_prompt=False)
    assert opened == closed + "<|assistant|>\n" and closed.endswith("the answer is <|end|>\n")
    assert r.render(MESSAGES, None, None, add_generation_prompt=False, continue_final=True) == closed.removesuffix(
        "<|end|>\n")


def test_continuation_of_content_the_template_trims() -> None:
    trimming = renderer("{% for m in messages %}[{{ m['content'] | trim }}]{% endfor %}")
    assert trimming.render(MESSAGES, None, None, continue_final=True) == "[hi][the answer is"
    for content in ("", None):
        with pytest.raises(ValueError, match="continue the final message"):
            trimming.render([{"role": "user", "content": content}], None, None, continue_final=True)


def test_free_variables_name_what_a_template_reads() -> None:
    assert "reasoning_effort" in renderer("{{ messages }}{{ reasoning_effort or 'low' }}").free_variables
    assert "reasoning_effort" not in renderer().free_variables and "messages" in renderer().free_variables
