"""The demo model's training mixture: deterministic, split cleanly, every known answer
consistent with its question; the chat template renders tools and calls as the server
does and parses back; the graders accept what is right and only that."""

from __future__ import annotations

import json
import re

import pytest

from sprig.runtime.demo import facts, mixture
from sprig.runtime.demo.chat_format import CHAT_TEMPLATE, tools_system_prompt
from sprig.runtime.demo.grading import json_reply, same_call, states, tool_calls
from sprig.runtime.demo.scoring import Measure, execute
from sprig.runtime.demo.tasks import split_of
from sprig.runtime.server.chat_render import ChatRenderer
from sprig.runtime.server.tool_formats import detect_format

TASKS = list(mixture.TASKS)


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(CHAT_TEMPLATE, {"bos_token": "<s>", "eos_token": "<|end|>"}, 10**6)


@pytest.mark.parametrize("task", TASKS)
def test_each_task_is_deterministic_and_its_splits_never_overlap(task: str) -> None:
    assert mixture.take_task(task, "train", 40, seed=3) == mixture.take_task(task, "train", 40, seed=3)
    assert mixture.take_task(task, "train", 40, seed=3) != mixture.take_task(task, "train", 40, seed=4)
    train = {d.key() for d in mixture.take_task(task, "train", 2000)}
    held = {d.key() for d in mixture.take_task(task, "heldout", 200)}
    assert len(train) == 2000 and len(held) == 200 and not train & held
    own = (lambda d: d.messages[0]["content"]) if task == "arithmetic" else (lambda d: d.key())  # its own stream
    assert all(split_of(own(d)) == "heldout" for d in mixture.take_task(task, "heldout", 200))


def test_the_mixture_interleaves_tasks_by_weight() -> None:
    dialogues = mixture.take("train", 4000)
    assert dialogues[:100] == mixture.take("train", 100)  # a longer run starts with a shorter one's data
    for name, task in mixture.TASKS.items():
        share = sum(d.task == name for d in dialogues) / len(dialogues)
        assert abs(share - task.weight) < 0.03, (name, share)


def test_the_mixture_can_leave_tasks_out_of_its_later_part() -> None:
    """Up to `from_` the data is the plain mixture's; after it, no dialogue of a task in
    `without`, the other tasks in their relative weights, and no dialogue seen twice."""
    plain = mixture.take("train", 3000)
    late = mixture.take("train", 3000, without=frozenset({"arithmetic"}), from_=1000)
    assert late[:1000] == plain[:1000]
    assert not any(d.task == "arithmetic" for d in late[1000:])
    assert len({d.key() for d in late}) == len(late)
    rest = 1 - mixture.TASKS["arithmetic"].weight
    for name in ("few-shot", "json"):
        share = sum(d.task == name for d in late[1000:]) / 2000
        assert abs(share - mixture.TASKS[name].weight / rest) < 0.04, (name, share)
    assert mixture.take("train", 50, without=frozenset({"json"}), from_=50) == plain[:50]
    with pytest.raises(ValueError, match="without"):
        mixture.take("train", 10, without=frozenset(mixture.TASKS))
    with pytest.raises(ValueError, match="without"):
        mixture.take("train", 10, without=frozenset({"poetry"}))


def test_the_template_writes_the_tool_call_format_the_server_parses(renderer: ChatRenderer) -> None:
    assert detect_format(CHAT_TEMPLATE).name == "hermes"
    for d in mixture.take_task("tools", "heldout", 200):
        text = renderer.render(list(d.messages), list(d.tools), None)
        calls = sum(bool(m.get("tool_calls")) for m in d.messages)
        assert text.count('{"name": ') == len(d.tools) + 1 + calls  # each tool, the format's line, each call
        for i in d.assistant_turns():
            m = d.messages[i]
            turn = text.split("<|assistant|>\n")[d.assistant_turns().index(i) + 1].split("<|end|>")[0]
            if m.get("tool_calls"):
                fn = m["tool_calls"][0]["function"]
                calls = tool_calls(turn)
                assert calls is not None and len(calls) == 1 and same_call(calls[0], fn["name"], fn["arguments"])
            else:
                assert tool_calls(turn) is None and turn == m["content"]


def test_transformers_and_the_server_render_every_task_alike(renderer: ChatRenderer) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), bos_token="<s>", eos_token="<|end|>")
    tok.chat_template = CHAT_TEMPLATE
    for task in TASKS:
        for d in mixture.take_task(task, "heldout", 40):
            tools = list(d.tools) if d.tools else None
            want = tok.apply_chat_template(list(d.messages), tools=tools, add_generation_prompt=True, tokenize=False)
            assert renderer.render(list(d.messages), tools, None) == want


def test_a_program_with_plain_roles_sends_what_the_server_renders_for_tools(renderer: ChatRenderer) -> None:
    d = mixture.take_task("tools", "heldout", 1)[0]
    opening = [m for m in d.messages[: d.assistant_turns()[0]] if m["role"] != "system"]
    by_role = renderer.render([{"role": "system", "content": tools_system_prompt(list(d.tools))}, *opening],
                              None, None)
    assert by_role == renderer.render(opening, list(d.tools), None)
    # a tool message renders as a user turn holding <tool_response>, which a program can write itself
    assert renderer.render([{"role": "tool", "content": "23"}], None, None) == renderer.render(
        [{"role": "user", "content": "<tool_response>\n23\n</tool_response>"}], None, None)


def test_tool_dialogues_results_follow_from_their_calls() -> None:
    for d in mixture.take_task("tools", "train", 500):
        calls = [i for i in d.assistant_turns() if d.messages[i].get("tool_calls")]
        for i in calls:
            fn = d.messages[i]["tool_calls"][0]["function"]
            assert d.messages[i + 1]["role"] == "tool"
            assert execute(d, fn["name"], fn["arguments"]) == d.messages[i + 1]["content"]
            assert fn["name"] in {t["function"]["name"] for t in d.tools}
        assert d.messages[-1]["content"] == d.answer or states(d.messages[-1]["content"], d.answer)
        if calls and d.answer.startswith("Answer:"):  # the calculator's last result is the answer
            assert d.answer == f"Answer: {d.messages[calls[-1] + 1]['content']}"


def test_extraction_answers_validate_and_come_from_the_text() -> None:
    for d in mixture.take_task("json", "train", 500):
        reply = d.messages[-1]["content"]
        valid, value = json_reply(reply, d.schema)
        assert valid and value == json.loads(d.answer) and list(value) == list(d.schema["properties"])
        prompt = "\n".join(m["content"] for m in d.messages[:-1])
        for v in value.values():
            for part in v if isinstance(v, list) else [v]:
                assert str(part) in prompt, (part, prompt)


def test_few_shot_answers_are_stated_in_the_facts() -> None:
    for d in mixture.take_task("few-shot", "train", 500):
        facts = d.messages[0]["content"]
        for i in d.assistant_turns():
            words = re.findall(r"[A-Z][a-z]+|\d+|[a-z]{3,}", d.messages[i]["content"])
            assert words and all(w in facts for w in words if w not in ("lives", "years", "old", "works",
                                                                         "favorite", "color", "named")), d


def test_asks_who_tells_who_has_a_fact_from_a_fact_about_someone() -> None:
    assert all(q.startswith("Who ") for qs, _, _ in facts.REVERSE.values() for q in qs)
    assert not any(q.startswith("Who ") for a in facts.ATTRIBUTES.values() for q in a.questions)
    kinds = {True: 0, False: 0}
    for d in mixture.take_task("few-shot", "heldout", 300):
        prompt = "\n".join(m["content"] for m in d.messages[:-1])
        names = facts.people(d)
        assert 2 <= len(names) <= 3 and all(re.fullmatch(r"[A-Z][a-z]+", n) for n in names), names
        who = facts.asks_who(d)
        kinds[who] += 1
        assert all(f"{name} " in prompt or f"{name}'s" in prompt for name in names)
        first = d.answer.split(" ")[0].split("'")[0]  # a sentence answer begins with its person
        assert first in names if who else d.answer not in names, d
    assert min(kinds.values()) > 30, kinds


def _kinds_by_person(d) -> dict[str, set[str]]:
    """Each person's kinds of facts, read off the fact lines of the dialogue's first turn."""
    kinds = {" lives in ": "city", " years old": "age", " works as ": "job", " favorite color ": "color",
             " named ": "pet"}
    out: dict[str, set[str]] = {}
    for line in facts.fact_lines(d):
        out.setdefault(facts.person(line), set()).update(k for marker, k in kinds.items() if marker in line)
    return out


def test_few_shot_training_draws_people_with_the_same_kinds_of_facts() -> None:
    """Training's few-shot dialogues: about `SHARED_KINDS_SHARE` of them give every person
    the same kinds of facts (a question's kind then never singles out its line); the
    held-out ones are the plain form's, in which people mostly differ."""
    def shared(d) -> bool:
        kinds = list(_kinds_by_person(d).values())
        return len(kinds) > 1 and all(k == kinds[0] for k in kinds)

    train = sum(shared(d) for d in mixture.take_task("few-shot", "train", 400)) / 400
    held = sum(shared(d) for d in mixture.take_task("few-shot", "heldout", 400)) / 400
    assert abs(train - facts.SHARED_KINDS_SHARE) < 0.1 and held < 0.2, (train, held)


def test_multi_turn_answers_follow_from_the_first_turn() -> None:
    for d in mixture.take_task("multi-turn", "train", 500):
        first, later = d.messages[0]["content"], d.messages[2]["content"]
        answer = d.messages[3]["content"]
        if answer.startswith("You") or answer.startswith("Your"):
            assert answer.split()[-1].rstrip(".") in first
        else:  # arithmetic that starts from the previous answer (or the number told)
            start = int(answer.split(" ")[0])
            assert str(start) in d.messages[1]["content"] or str(start) in first, (first, later, answer)


@pytest.mark.parametrize(
    ("reply", "answer", "right"),
    [("3 + 4 = 7\nAnswer: 7", "Answer: 7", True), ("Answer: 8", "Answer: 7", False),
     ("Rex", "Rex", True), (" Rex\n", "Rex", True), ("Rex.", "Rex", False), ("Answer: 7 then", "Answer: 7", False)],
)
def test_states(reply: str, answer: str, right: bool) -> None:
    assert states(reply, answer) is right


def test_tool_calls_are_read_only_when_well_formed() -> None:
    ok = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    calls = tool_calls(ok)
    assert calls is not None and same_call(calls[0], "add", {"a": 1, "b": 2})
    assert not same_call(calls[0], "add", {"a": 1, "b": "2"})
    for bad in ('<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>', "Answer: 3", ok[:-2]):
        assert tool_calls(bad) is None


def test_json_reply() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert json_reply('{"n": 3}', schema) == (True, {"n": 3})
    assert json_reply('{"n": "3"}', schema) == (False, {"n": "3"})
    assert json_reply('{"n": 3', schema) == (False, None)


def test_copying_dialogues_repeat_their_words_and_split_cleanly() -> None:
    from sprig.runtime.demo.copying import take_copies

    train = take_copies("train", 2000)
    held = take_copies("heldout", 200)
    assert train == take_copies("train", 2000) and train != take_copies("train", 2000, seed=1)
    assert len({d.key() for d in train}) == 2000 and not {d.key() for d in train} & {d.key() for d in held}
    for d in train + held:
        asked, answer = d.messages[0]["content"], d.messages[1]["content"]
        assert asked == f"Repeat: {answer}" and d.answer == answer and 2 <= len(answer.split()) <= 5


def test_an_accuracy_comes_with_its_wilson_interval() -> None:
    """The 95% Wilson interval: with no right answers its top is z^2 / (n + z^2); it is
    symmetric under swapping right and wrong, holds the rate, and narrows with more data."""
    low, high = Measure("t", "m", 0, 10).interval()
    assert low == 0.0 and high == pytest.approx(1.96**2 / (10 + 1.96**2))
    low, high = Measure("t", "m", 158, 200).interval()
    flipped = Measure("t", "m", 42, 200).interval()
    assert (low, high) == pytest.approx((1 - flipped[1], 1 - flipped[0]))
    assert low < 0.79 < high and round(low, 3) == 0.728 and round(high, 3) == 0.841
    wide, narrow = high - low, Measure("t", "m", 790, 1000).interval()
    assert narrow[1] - narrow[0] < wide / 2
    assert Measure("t", "m", 0, 0).interval() == (0.0, 1.0)
