"""Roles render through the backend's chat template; `messages()` is OpenAI format."""

from __future__ import annotations

import pytest
from scripted_backend import ScriptedBackend

import sprig as sgl
from sprig.chat_template import ChatTemplate, get_chat_template, get_chat_template_by_model_path
from sprig.template_source import from_jinja, resolve_chat_template

CHATML = get_chat_template("chatml")


def test_roles_render_with_the_template_and_messages_are_openai_format() -> None:
    backend = ScriptedBackend(["Paris"], chat_template=CHATML)

    @sgl.function
    def program(s, question):
        s += sgl.system("Be brief.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer"))

    state = program.run(question="Capital of France?", backend=backend)
    assert state.text() == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis<|im_end|>\n"
    )
    assert state.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
    ]
    call = backend.calls[0]
    assert call.prompt.text.endswith("<|im_start|>assistant\n")
    assert call.prompt.open_role == "assistant" and call.prompt.open_role_text == ""
    assert [m["role"] for m in call.prompt.messages] == ["system", "user"]
    assert call.params.stop == ("<|im_end|>",)  # the template's stop string joins every gen


def test_context_manager_roles_begin_end_markers_and_state_methods() -> None:
    backend = ScriptedBackend(["fine"], chat_template=CHATML)

    @sgl.function
    def program(s):
        with s.user():
            s += "How are you?"
        s += sgl.assistant_begin()
        s += sgl.gen("reply")
        s += sgl.assistant_end()
        s.user("Good.")

    state = program.run(backend=backend)
    assert [m["content"] for m in state.messages()] == ["How are you?", "fine", "Good."]
    assert state.text().count("<|im_start|>") == 3


def test_default_system_prompt_is_inserted_before_the_first_non_system_turn() -> None:
    backend = ScriptedBackend([], chat_template=get_chat_template("qwen"))

    @sgl.function
    def program(s):
        s += sgl.user("hi")

    state = program.run(backend=backend)
    assert state.messages() == [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "hi"},
    ]


def test_llama2_layout_puts_the_system_block_inside_the_first_user_turn() -> None:
    template = get_chat_template("llama-2-chat")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert template.render(messages) == "[INST] <<SYS>>\nS\n<</SYS>>\n\nU [/INST]"


def test_nested_roles_are_an_error_raised_from_run() -> None:
    @sgl.function
    def program(s):
        s += sgl.user_begin()
        s += sgl.assistant_begin()

    with pytest.raises(ValueError, match="do not nest"):
        program.run(backend=ScriptedBackend([]))


def test_model_path_matching_and_default() -> None:
    assert get_chat_template_by_model_path("/m/Meta-Llama-3-8B-Instruct").name == "llama-3-instruct"
    assert get_chat_template_by_model_path("Qwen/Qwen2-7B-Instruct").name == "qwen"
    assert get_chat_template_by_model_path("/tmp/tiny").name == "default"


QWEN_JINJA = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GEMMA_JINJA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)


def test_role_boundaries_are_derived_from_a_jinja_template() -> None:
    derived = from_jinja(QWEN_JINJA)
    assert derived.roles == CHATML.roles
    assert derived.default_system_prompt == "You are a helpful assistant."
    assert derived.stop_str == ("<|im_end|>",)
    gemma = from_jinja(GEMMA_JINJA, bos_token="<bos>")
    assert gemma.roles["system"] == ("", "")
    assert gemma.roles["user"] == ("<start_of_turn>user\n", "<end_of_turn>\n")
    assert gemma.roles["assistant"] == ("<start_of_turn>model\n", "<end_of_turn>\n")


def test_template_resolution_order() -> None:
    roles = {"chat_roles": {r: [f"<{r}>", f"</{r}>"] for r in ("system", "user", "assistant")},
             "stop_str": ["</assistant>"], "model_path": "llama-3-instruct"}
    assert resolve_chat_template(roles).roles["user"] == ("<user>", "</user>")
    assert resolve_chat_template(roles, "chatml") is CHATML
    assert resolve_chat_template({"chat_template": QWEN_JINJA}).default_system_prompt
    broken = {"chat_template": "{{ raise_exception('no') }}", "model_path": "x-chatml"}
    assert resolve_chat_template(broken) is CHATML
    assert resolve_chat_template({}).name == "default"
    back = ChatTemplate.from_dict(CHATML.to_dict())
    assert (back.roles, back.stop_str) == (CHATML.roles, CHATML.stop_str)
