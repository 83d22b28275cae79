"""Chat rendering options: no generation prompt, continuing the final message (cut where
its content ends, as transformers does), and the variables a template reads."""

from __future__ import annotations

import re
from pathlib import Path

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


# openai/gpt-oss-120b's chat template (Apache-2.0), as llama.cpp keeps a copy of it
# (models/templates/openai-gpt-oss-120b.jinja, ggml-org/llama.cpp commit b204a5a2)
GPT_OSS = (Path(__file__).parent / "fixtures" / "gpt_oss_chat_template.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "the city", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer"}}, "required": ["city"]}}}
CONVERSATION = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "thinking": "I should call the tool.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
HARMONY = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n"
    "Current date: {date}\n\nReasoning: high\n\n# Valid channels: analysis, commentary, final. Channel must be "
    "included for every message.\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\nnamespace functions {{\n\n"
    '// Get the weather\ntype get_weather = (_: {{\n// the city\ncity: "Paris" | "Rome",\ndays?: number,\n}}) => any;'
    "\n\n}} // namespace functions<|end|><|start|>user<|message|>Weather in Paris?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>I should call the tool.<|end|>"
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{{"city": "Paris"}}<|call|>'
    '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|><|start|>assistant'
)


def test_gpt_oss_template_renders_harmony_as_transformers_does() -> None:
    """System, developer (with tools), user, an assistant call with its reasoning, the
    tool's result: the harmony text, equal to what transformers renders (`strftime_now`
    gives today's date in both)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    ours = renderer(GPT_OSS).render(CONVERSATION, [WEATHER], {"reasoning_effort": "high"})
    date = re.search(r"Current date: (\d{4}-\d\d-\d\d)\n", ours)[1]
    assert ours == HARMONY.format(date=date)
    theirs = render_jinja_template([CONVERSATION], tools=[WEATHER], chat_template=GPT_OSS,
                                   add_generation_prompt=True, reasoning_effort="high")[0][0]
    assert ours == theirs


def test_gpt_oss_template_drops_earlier_reasoning_and_ends_a_continued_answer_open() -> None:
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello.", "thinking": "greet"},
                    {"role": "user", "content": "again"}]
    text = renderer(GPT_OSS).render(conversation, None, None)
    assert text.endswith("<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>Hello.<|end|>"
                         "<|start|>user<|message|>again<|end|><|start|>assistant")
    assert "greet" not in text and "Reasoning: medium" in text and "<|start|>developer" not in text
    cont = renderer(GPT_OSS).render([*conversation[:1], {"role": "assistant", "content": "Hel"}], None, None,
                                    add_generation_prompt=False, continue_final=True)
    assert cont.endswith("<|start|>assistant<|channel|>final<|message|>Hel")
