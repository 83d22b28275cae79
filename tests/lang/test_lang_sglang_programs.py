"""Programs written the way SGLang's README and examples write them run unchanged."""

from __future__ import annotations

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
