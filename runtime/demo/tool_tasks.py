"""Tool use: the model reads the tools the template renders, calls one in the Hermes
format, reads the result, and calls the next tool or answers.

Two kinds of request, each offered the tools it needs among others, in random order:
- an arithmetic word problem (`tasks.make_problem`, up to three steps) solved with
  calculator tools, one call per step, each on the previous result; the answer is
  `Answer: N`. The tools' parameter names vary (`a`/`b`, `x`/`y`, ...), so the call must
  copy them from the schema;
- a lookup (weather, local time, a price) or an action (send an email) whose arguments
  come from the question and whose result the answer restates.
One dialogue in ten asks an arithmetic question without calculator tools among them,
which the model answers with its worked solution, calling nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sprig.runtime.demo import words
from sprig.runtime.demo.dialogue import Dialogue, Message, assistant, system, user
from sprig.runtime.demo.tasks import make_problem

ARITHMETIC = {
    "add": ("Add two whole numbers.", lambda a, b: a + b),
    "subtract": ("Subtract the second whole number from the first.", lambda a, b: a - b),
    "multiply": ("Multiply two whole numbers.", lambda a, b: a * b),
    "divide": ("Divide the first whole number by the second, rounding down.", lambda a, b: a // b if b else 0),
}
PARAMETER_NAMES = [("a", "b"), ("a", "b"), ("x", "y"), ("first", "second")]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Use the tools when they help.", "Answer the user's question."]
_SUBJECTS = ["the meeting", "the party", "the report", "lunch", "the trip", "the budget", "the game"]


@dataclass(frozen=True)
class Lookup:
    """A tool that looks something up or acts: its description, string parameters, the
    questions that need it, how a result is drawn, and the answer that restates it."""

    description: str
    params: tuple[str, ...]
    questions: tuple[str, ...]
    draw_args: Callable[[random.Random], dict[str, str]]
    draw_result: Callable[[random.Random], str]
    answer: str


LOOKUPS = {
    "get_weather": Lookup(
        "Get the current weather in a city.", ("city",),
        ("What is the weather in {city}?", "How is the weather in {city} today?"),
        lambda r: {"city": r.choice(words.CITIES)},
        lambda r: f"{r.choice(words.WEATHER)}, {r.randint(-5, 35)} C",
        "It is {result} in {city}.",
    ),
    "get_time": Lookup(
        "Get the local time in a city.", ("city",),
        ("What time is it in {city}?", "What is the time in {city} now?"),
        lambda r: {"city": r.choice(words.CITIES)},
        lambda r: f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}",
        "It is {result} in {city}.",
    ),
    "get_price": Lookup(
        "Get the price of an item in dollars.", ("item",),
        ("How much does a {item} cost?", "What is the price of a {item}?"),
        lambda r: {"item": r.choice(words.GOODS)},
        lambda r: str(r.randint(2, 300)),
        "A {item} costs {result} dollars.",
    ),
    "send_email": Lookup(
        "Send an email to a person.", ("to", "subject"),
        ("Send an email to {to} about {subject}.", "Email {to} about {subject}."),
        lambda r: {"to": words.first_name(r), "subject": r.choice(_SUBJECTS)},
        lambda r: "sent",
        "I sent the email to {to}.",
    ),
}


def arithmetic_tool(name: str, params: tuple[str, str]) -> dict[str, Any]:
    """An OpenAI function tool for one calculator operation."""
    props = {p: {"type": "integer"} for p in params}
    return _tool(name, ARITHMETIC[name][0], props)


def lookup_tool(name: str) -> dict[str, Any]:
    """An OpenAI function tool for one lookup."""
    return _tool(name, LOOKUPS[name].description, {p: {"type": "string"} for p in LOOKUPS[name].params})


def _tool(name: str, description: str, props: dict[str, Any]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": props, "required": list(props)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def call(name: str, arguments: dict[str, Any]) -> Message:
    """An assistant turn that makes one call."""
    fn = {"name": name, "arguments": arguments}
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": fn}]}


def tool_result(content: str) -> Message:
    return {"role": "tool", "content": content}


def _toolset(rng: random.Random, needed: list[dict[str, Any]], params: tuple[str, str],
             calculator: bool) -> tuple[dict[str, Any], ...]:
    """The needed tools and up to two others, shuffled."""
    names = {t["function"]["name"] for t in needed}
    spare = [lookup_tool(n) for n in LOOKUPS if n not in names]
    if calculator:
        spare += [arithmetic_tool(n, params) for n in ARITHMETIC if n not in names]
    tools = needed + rng.sample(spare, rng.choice([0, 0, 1, 1, 2]))
    rng.shuffle(tools)
    return tuple(tools)


def _opening(rng: random.Random, question: str) -> list[Message]:
    head = [system(rng.choice(SYSTEM_PROMPTS))] if rng.random() < 0.2 else []
    return [*head, user(question)]


def calculator_dialogue(rng: random.Random) -> Dialogue:
    """A word problem solved by calling calculator tools, step by step."""
    problem = make_problem(rng, max_steps=3)
    params = rng.choice(PARAMETER_NAMES)
    ops = list(dict.fromkeys(s.op for s in problem.steps))
    tools = _toolset(rng, [arithmetic_tool(op, params) for op in ops], params, calculator=True)
    messages = _opening(rng, problem.question)
    value = problem.start
    for s in problem.steps:
        messages.append(call(s.op, {params[0]: value, params[1]: s.operand}))
        messages.append(tool_result(str(s.value)))
        value = s.value
    messages.append(assistant(f"Answer: {value}"))
    return Dialogue("tools", tuple(messages), f"Answer: {value}", tools)


def lookup_dialogue(rng: random.Random) -> Dialogue:
    """A question answered by one lookup or action."""
    name = rng.choice(list(LOOKUPS))
    lookup = LOOKUPS[name]
    args = lookup.draw_args(rng)
    result = lookup.draw_result(rng)
    params = rng.choice(PARAMETER_NAMES)
    tools = _toolset(rng, [lookup_tool(name)], params, calculator=rng.random() < 0.5)
    messages = _opening(rng, rng.choice(lookup.questions).format(**args))
    final = lookup.answer.format(result=result, **args)
    messages += [call(name, args), tool_result(result), assistant(final)]
    return Dialogue("tools", tuple(messages), final, tools)


def no_tool_dialogue(rng: random.Random) -> Dialogue:
    """An arithmetic question where no calculator is offered: worked out, nothing called."""
    problem = make_problem(rng)
    tools = _toolset(rng, [lookup_tool(rng.choice(list(LOOKUPS)))], ("a", "b"), calculator=False)
    messages = [*_opening(rng, problem.question), assistant(problem.solution)]
    return Dialogue("tools", tuple(messages), f"Answer: {problem.answer}", tools)


KINDS: dict[Callable[[random.Random], Dialogue], float] = {
    calculator_dialogue: 0.55,
    lookup_dialogue: 0.35,
    no_tool_dialogue: 0.10,
}


def make_tool_dialogue(rng: random.Random) -> Dialogue:
    """One tool-use dialogue, of a kind drawn by `KINDS`' weights."""
    return rng.choices(list(KINDS), weights=list(KINDS.values()))[0](rng)
