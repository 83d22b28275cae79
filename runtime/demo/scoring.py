"""Held-out evaluation of the demo model on sprig's offline engine, one scorer per task.

Prompts are rendered with the checkpoint's chat template and tokenized without added
special tokens, as the server does; replies are greedy unless a measure says otherwise.
Each scorer returns `Measure`s: how many of how many were right, and the target the
model is held to (README, `scripts/eval_demo_model.py`).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sprig.runtime.demo.dialogue import Dialogue, Message
from sprig.runtime.demo.facts import asks_who, people
from sprig.runtime.demo.grading import json_reply, same_call, states, tool_calls
from sprig.runtime.demo.tasks import Problem, extract_answer
from sprig.runtime.demo.tool_tasks import ARITHMETIC, call, tool_result


@dataclass(frozen=True)
class Measure:
    task: str
    what: str
    right: int
    total: int
    target: str = ""

    @property
    def rate(self) -> float:
        return self.right / max(self.total, 1)

    def interval(self, z: float = 1.96) -> tuple[float, float]:
        """The Wilson score interval of the rate (95% for z = 1.96): where the accuracy on
        endless held-out data lies, given `right` of `total`; (0, 1) with no data."""
        if self.total == 0:
            return 0.0, 1.0
        n, p = self.total, self.rate
        mid = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return max(0.0, mid - half), min(1.0, mid + half)


def prompt_ids(tok: Any, messages: Sequence[Message], tools: Sequence[dict] | None) -> list[int]:
    """The conversation up to the assistant's next turn, as the server tokenizes it."""
    text = tok.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                   add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def complete(engine: Any, prompts: list[list[int]], max_new_tokens: int, each: Sequence[dict] | None = None,
             **params: Any) -> list[str]:
    """Greedy replies (or as `params` say, and `each` prompt's own parameters), in order."""
    if not prompts:
        return []
    base = {"max_new_tokens": max_new_tokens, "temperature": 0, **params}
    sampling = [{**base, **own} for own in each] if each is not None else base
    return [o["text"] for o in engine.generate(input_ids=prompts, sampling_params=sampling)]


def _gold_call(message: Message) -> tuple[str, dict[str, Any]]:
    fn = message["tool_calls"][0]["function"]
    return fn["name"], fn["arguments"]


def score_tools(engine: Any, tok: Any, dialogues: list[Dialogue]) -> list[Measure]:
    """Every assistant turn given the dialogue's own history (a call, or the answer after
    the last result), then whole runs where the model's calls are executed and their
    results handed back."""
    prompts, gold = [], []
    for d in dialogues:
        for i in d.assistant_turns():
            prompts.append(prompt_ids(tok, d.messages[:i], d.tools))
            gold.append(d.messages[i])
    replies = complete(engine, prompts, 96)
    formed = right = expected = answered = finals = 0
    for reply, want in zip(replies, gold, strict=True):
        calls = tool_calls(reply)
        if want.get("tool_calls"):
            expected += 1
            formed += calls is not None
            right += calls is not None and len(calls) == 1 and same_call(calls[0], *_gold_call(want))
        else:
            finals += 1
            answered += calls is None and states(reply, want["content"])
    solved = sum(states(r, d.answer) for d, r in zip(dialogues, run_agents(engine, tok, dialogues), strict=True))
    return [
        Measure("tools", "calls well-formed", formed, expected, ">= 95%"),
        Measure("tools", "calls correct", right, expected, ">= 80%"),
        Measure("tools", "answer after the results", answered, finals),
        Measure("tools", "solved, running its own calls", solved, len(dialogues)),
    ]


def execute(dialogue: Dialogue, name: str, arguments: dict[str, Any]) -> str:
    """What a tool returns: calculator tools compute; a lookup returns the dialogue's
    result for exactly the dialogue's arguments, an error otherwise."""
    values = list(arguments.values())
    if name in ARITHMETIC and len(values) == 2 and all(isinstance(v, int) for v in values):
        return str(ARITHMETIC[name][1](*values))
    for i in dialogue.assistant_turns():
        m = dialogue.messages[i]
        if m.get("tool_calls") and _gold_call(m) == (name, arguments):
            return dialogue.messages[i + 1]["content"]
    return "error: no such call"


def run_agents(engine: Any, tok: Any, dialogues: list[Dialogue], rounds: int = 6) -> list[str]:
    """Each dialogue's opening, then the model's turns: calls are executed (`execute`)
    and answered, until it replies without one (its final reply; "" if it never does)."""
    convs = [list(d.messages[: d.assistant_turns()[0]]) for d in dialogues]
    finals = [""] * len(dialogues)
    active = list(range(len(dialogues)))
    for _ in range(rounds):
        replies = complete(engine, [prompt_ids(tok, convs[i], dialogues[i].tools) for i in active], 96)
        still = []
        for i, reply in zip(active, replies, strict=True):
            calls = tool_calls(reply)
            if not calls:
                finals[i] = reply
                continue
            for c in calls:
                args = json.loads(c.arguments)
                convs[i] += [call(c.name, args), tool_result(execute(dialogues[i], c.name, args))]
            still.append(i)
        active = still
    return finals


def score_json(engine: Any, tok: Any, dialogues: list[Dialogue]) -> list[Measure]:
    """The answer written freely, and constrained to the dialogue's schema."""
    prompts = [prompt_ids(tok, d.messages[:-1], None) for d in dialogues]
    free = complete(engine, prompts, 128)
    bound = complete(engine, prompts, 128, each=[{"json_schema": json.dumps(d.schema)} for d in dialogues])
    out = []
    for how, replies, targets in (("unconstrained", free, (">= 95%", "")), ("constrained", bound, ("", ">= 80%"))):
        graded = [json_reply(r, d.schema) for r, d in zip(replies, dialogues, strict=True)]
        right = sum(v == json.loads(d.answer) for (_, v), d in zip(graded, dialogues, strict=True))
        out += [Measure("json", f"valid, {how}", sum(ok for ok, _ in graded), len(dialogues), targets[0]),
                Measure("json", f"correct, {how}", right, len(dialogues), targets[1])]
    return out


def score_few_shot(engine: Any, tok: Any, dialogues: list[Dialogue]) -> list[Measure]:
    """The last question, with the facts and the answered shots before it; also split by
    the kind of question (`facts.asks_who`): a fact about a named person ("Where does Omar
    live?"), or who has a fact ("Who lives in Oslo?", answered with a name)."""
    replies = complete(engine, [prompt_ids(tok, d.messages[:-1], None) for d in dialogues], 48)
    right = [states(r, d.answer) for r, d in zip(replies, dialogues, strict=True)]
    who = [asks_who(d) for d in dialogues]
    chance = sum(1 / len(people(d)) for d, w in zip(dialogues, who, strict=True) if w) / max(who.count(True), 1)
    by_kind = {kind: sum(r for r, w in zip(right, who, strict=True) if w is kind) for kind in (False, True)}
    return [Measure("few-shot", "answer right, in the shots' style", sum(right), len(dialogues), ">= 80%"),
            Measure("few-shot", "of which about a named person", by_kind[False], who.count(False)),
            Measure("few-shot", f"of which who has a fact (a name of the prompt at random: {chance:.1%})",
                    by_kind[True], who.count(True))]


def score_multi_turn(engine: Any, tok: Any, dialogues: list[Dialogue]) -> list[Measure]:
    """Every turn answered by the model after its own earlier replies; the last graded."""
    convs: list[list[Message]] = [[] for _ in dialogues]
    replies = [""] * len(dialogues)
    for turn in range(max(len(d.assistant_turns()) for d in dialogues)):
        live = [i for i, d in enumerate(dialogues) if turn < len(d.assistant_turns())]
        for i in live:
            d = dialogues[i]
            start = d.assistant_turns()[turn - 1] + 1 if turn else 0
            convs[i] += d.messages[start : d.assistant_turns()[turn]]
        out = complete(engine, [prompt_ids(tok, convs[i], None) for i in live], 128)
        for i, reply in zip(live, out, strict=True):
            convs[i].append({"role": "assistant", "content": reply})
            replies[i] = reply
    right = sum(states(r, d.answer) for r, d in zip(replies, dialogues, strict=True))
    return [Measure("multi-turn", "last turn right, after its own replies", right, len(dialogues), ">= 70%")]


SCORERS: dict[str, Callable[[Any, Any, list[Dialogue]], list[Measure]]] = {
    "tools": score_tools,
    "json": score_json,
    "few-shot": score_few_shot,
    "multi-turn": score_multi_turn,
}


def score_arithmetic(engine: Any, tok: Any, problems: list[Problem], samples: int, seed: int,
                     temperature: float, top_p: float) -> list[Measure]:
    """Greedy, and `samples` seeded samples per problem: the first alone, their majority
    vote, and whether any is right."""
    prompts = [prompt_ids(tok, [{"role": "user", "content": p.question}], None) for p in problems]
    greedy = complete(engine, prompts, 128)
    sampled = complete(engine, prompts, 128, temperature=temperature, top_p=top_p, n=samples, seed=seed)
    right = {"greedy": 0, "one sample": 0, f"majority of {samples}": 0, f"any of {samples}": 0}
    for k, p in enumerate(problems):
        answers = [extract_answer(t) for t in sampled[k * samples : (k + 1) * samples]]
        votes = Counter(a for a in answers if a is not None)
        right["greedy"] += extract_answer(greedy[k]) == p.answer
        right["one sample"] += answers[0] == p.answer
        right[f"majority of {samples}"] += bool(votes) and votes.most_common(1)[0][0] == p.answer
        right[f"any of {samples}"] += p.answer in answers
    targets = {"greedy": "40-70%", f"majority of {samples}": ">= greedy + 4 points"}
    return [Measure("arithmetic", what, n, len(problems), targets.get(what, "")) for what, n in right.items()]
