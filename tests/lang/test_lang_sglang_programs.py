"""Programs written the way SGLang's README and examples write them run unchanged."""

from __future__ import annotations

import pytest
from scripted_backend import ScriptedBackend

import sprig as sgl


@sgl.function
def multi_turn_question(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=256))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=256))


@sgl.function
def tip_suggestion(s):
    s += "Here are two tips for staying healthy: 1. Balanced Diet. 2. Regular Exercise.\n\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Now, expand tip {i + 1} into a paragraph:\n"
        f += sgl.gen("detailed_tip", max_tokens=256, stop="\n\n")
    s += "Tip 1:" + forks[0]["detailed_tip"] + "\n"
    s += "Tip 2:" + forks[1]["detailed_tip"] + "\n"
    s += "In summary" + sgl.gen("summary")


@sgl.function
def tool_use(s, question):
    s += "To answer this question: " + question + ". "
    s += "I need to use a " + sgl.gen("tool", choices=["calculator", "search engine"]) + ". "
    if s["tool"] == "calculator":
        s += "The math expression is" + sgl.gen("expression")
    elif s["tool"] == "search engine":
        s += "The key word to search is" + sgl.gen("word")


def reply_by_prompt(text: str, params) -> str:
    if text.endswith("paragraph:\n"):
        return "Eat well." if "tip 1" in text else "Move daily."
    return "ANSWER"


def test_multi_turn_chat_batch_and_stream() -> None:
    sgl.set_default_backend(ScriptedBackend(reply_by_prompt))
    state = multi_turn_question.run(question_1="What is the capital of France?", question_2="And Japan?")
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert state["answer_1"] == state["answer_2"] == "ANSWER"

    states = multi_turn_question.run_batch(
        [{"question_1": f"q{i}", "question_2": "again?"} for i in range(3)], progress_bar=False
    )
    assert [s.messages()[1]["content"] for s in states] == ["q0", "q1", "q2"]

    streamed = multi_turn_question.run(question_1="a", question_2="b", stream=True)
    assert "".join(streamed.text_iter()) == streamed.text()


def test_fork_without_join_and_tool_selection() -> None:
    backend = ScriptedBackend(reply_by_prompt)
    state = tip_suggestion.run(backend=backend)
    assert "Tip 1:Eat well.\nTip 2:Move daily.\nIn summaryANSWER" in state.text()

    def prefers_calculator(context: str, char: str) -> float:
        return -0.1 if context.endswith("use a ") and char == "c" else -1.0

    state = tool_use.run(question="What is 2 + 2", backend=ScriptedBackend(reply_by_prompt, logprob=prefers_calculator))
    assert state["tool"] == "calculator"
    assert state.text().endswith("I need to use a calculator. The math expression isANSWER")


@sgl.function
def expand_tips(s, n):
    s += "Tips:\n"
    forks = s.fork(n)
    for i in range(n):
        forks[i] += f"Now, expand tip {i + 1} into a paragraph:\n"  # item assignment, as SGLang writes it
        forks[i] += sgl.gen("detailed_tip", max_tokens=16)
    with pytest.raises(ValueError, match="cannot be replaced"):
        forks[0] = forks[1]
    forks.join()


def test_fork_items_take_augmented_assignment() -> None:
    state = expand_tips.run(n=2, backend=ScriptedBackend(reply_by_prompt))
    assert state["detailed_tip"] == ["Eat well.", "Move daily."]


def test_dtype_str_keeps_the_text_as_generated() -> None:
    @sgl.function
    def name(s):
        s += "Full name: " + sgl.gen("str_res", dtype=str, stop="\n") + "\n"
        s += "Year: " + sgl.gen("int_res", dtype=int)

    state = name.run(backend=ScriptedBackend(['"Domain Name', "1983"]))  # a stop cut the string
    assert state["str_res"] == '"Domain Name' and state["int_res"] == 1983
    assert state.text() == 'Full name: "Domain Name\nYear: 1983'


@pytest.mark.parametrize(
    ("model_type", "reply", "reasoning", "answer"),
    [
        ("deepseek-r1", "weigh it up</think>\n\nParis", "weigh it up", "Paris"),
        ("qwen3", "<think>\nhmm\n</think>\n\nParis", "hmm", "Paris"),
        ("qwen3", "Paris", "", "Paris"),
        ("deepseek-r1", "<think>cut short", "cut short", ""),
    ],
)
def test_separate_reasoning_binds_reasoning_and_answer(model_type, reply, reasoning, answer) -> None:
    @sgl.function
    def ask(s):
        s += sgl.user("Capital of France?")
        s += sgl.assistant(sgl.separate_reasoning(sgl.gen("answer", max_tokens=32), model_type=model_type))
        s += sgl.user("Sure?")

    backend = ScriptedBackend([reply])
    state = ask.run(backend=backend)
    assert state["answer"] == answer and state["answer_reasoning_content"] == reasoning
    assert state.messages()[1] == {"role": "assistant", "content": answer}  # later turns see no thinking
    assert reply not in state.text() or reply == answer


def test_separate_reasoning_needs_a_known_format_and_a_named_gen() -> None:
    with pytest.raises(ValueError, match="model_type"):
        sgl.separate_reasoning(sgl.gen("a"), model_type="nope")
    with pytest.raises(ValueError, match="named gen"):
        sgl.separate_reasoning(sgl.gen(), model_type="qwen3")
