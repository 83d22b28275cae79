"""Few-shot question answering over facts given in the prompt.

Two or three people each get two to four facts (where they live, their age, job, favorite
color, a pet's name), stated one to a line in a system turn or at the head of the first
user turn. One to three questions answered in earlier turns (the shots) show the style
of answer — the bare value, or a sentence — and the last question is answered in the
same style. Every question has one answer in the facts.

Training draws a share of its dialogues (`SHARED_KINDS_SHARE`) with every person given
the same kinds of facts (`make_facts_training_dialogue`): there the kind of fact a question
asks never singles out its line, only the person's name does.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sprig.runtime.demo import words
from sprig.runtime.demo.dialogue import Dialogue, Message, assistant, system, user


def _job(job: str) -> dict[str, str]:
    return {"job": job, "a_job": words.article(job)}


@dataclass(frozen=True)
class Attribute:
    """A kind of fact: how it is drawn, stated, asked, and answered (short and long)."""

    draw: Callable[[random.Random], dict[str, Any]]
    fact: str
    questions: tuple[str, ...]
    short: str
    sentence: str


ATTRIBUTES = {
    "city": Attribute(lambda r: {"city": r.choice(words.CITIES)}, "{p} lives in {city}.",
                      ("Where does {p} live?", "Which city does {p} live in?"), "{city}", "{p} lives in {city}."),
    "age": Attribute(lambda r: {"age": r.randint(5, 90)}, "{p} is {age} years old.",
                     ("How old is {p}?",), "{age}", "{p} is {age} years old."),
    "job": Attribute(lambda r: _job(r.choice(words.JOBS)), "{p} works as {a_job}.",
                     ("What is {p}'s job?", "What does {p} do for a living?"), "{job}", "{p} works as {a_job}."),
    "color": Attribute(lambda r: {"color": r.choice(words.COLORS)}, "{p}'s favorite color is {color}.",
                       ("What is {p}'s favorite color?",), "{color}", "{p}'s favorite color is {color}."),
    "pet": Attribute(lambda r: {"animal": r.choice(words.ANIMALS), "pet": r.choice(words.PET_NAMES)},
                     "{p} has a {animal} named {pet}.", ("What is the name of {p}'s {animal}?",),
                     "{pet}", "{p}'s {animal} is named {pet}."),
}
# asked the other way round: who has this fact (only when one person has it)
REVERSE = {
    "city": (("Who lives in {city}?",), "{p}", "{p} lives in {city}."),
    "job": (("Who works as {a_job}?",), "{p}", "{p} works as {a_job}."),
}
SHARED_KINDS_SHARE = 0.8  # of the training dialogues
INSTRUCTIONS = ["Answer questions using these facts.", "Use these facts to answer.", "Facts:"]


def fact_lines(dialogue: Dialogue) -> list[str]:
    """The dialogue's fact lines: those of its first turn after the instruction, up to the
    blank line before a question."""
    return dialogue.messages[0]["content"].split("\n\n")[0].split("\n")[1:]


def person(line: str) -> str:
    """Whom a fact line is about: its first word, without a possessive 's."""
    return line.split(" ")[0].split("'")[0]


def people(dialogue: Dialogue) -> set[str]:
    """The names of the people the dialogue's facts are about."""
    return {person(line) for line in fact_lines(dialogue)}


def asks_who(dialogue: Dialogue) -> bool:
    """Whether the dialogue's last question asks who has a fact (a `REVERSE` question,
    answered with a name), not a fact about a named person. Every `REVERSE` question and
    no `ATTRIBUTES` question starts with "Who "."""
    return dialogue.messages[-2]["content"].rsplit("\n", 1)[-1].startswith("Who ")


def _questions(rng: random.Random, facts: list[tuple[str, str, dict[str, Any]]],
               long: bool) -> list[tuple[str, str]]:
    """Every (question, answer) the facts answer without ambiguity, shuffled."""
    out = []
    for p, kind, values in facts:
        a = ATTRIBUTES[kind]
        out.append((rng.choice(a.questions).format(p=p, **values),
                    (a.sentence if long else a.short).format(p=p, **values)))
        if kind in REVERSE:
            key = next(iter(values))
            if sum(k == kind and v[key] == values[key] for _, k, v in facts) == 1:
                questions, short, sentence = REVERSE[kind]
                out.append((rng.choice(questions).format(**values),
                            (sentence if long else short).format(p=p, **values)))
    rng.shuffle(out)
    return out


def make_facts_dialogue(rng: random.Random, shared_kinds: bool = False) -> Dialogue:
    """Facts, one to three answered questions, and the question to answer. Each person
    has two to four kinds of facts of their own, or with `shared_kinds` the same two to
    four kinds as everyone else."""
    people = words.distinct(rng, words.first_name, rng.randint(2, 3))
    shared = rng.sample(list(ATTRIBUTES), rng.randint(2, 4)) if shared_kinds else None
    facts = [(p, kind, ATTRIBUTES[kind].draw(rng)) for p in people
             for kind in shared or rng.sample(list(ATTRIBUTES), rng.randint(2, 4))]
    rng.shuffle(facts)
    lines = "\n".join(ATTRIBUTES[kind].fact.format(p=p, **values) for p, kind, values in facts)
    asked = _questions(rng, facts, long=rng.random() < 0.5)[: rng.randint(2, 4)]
    head = f"{rng.choice(INSTRUCTIONS)}\n{lines}"
    messages: list[Message] = [system(head)] if rng.random() < 0.5 else []
    for i, (question, answer) in enumerate(asked):
        text = f"{head}\n\n{question}" if i == 0 and not messages else question
        messages += [user(text), assistant(answer)]
    return Dialogue("few-shot", tuple(messages), asked[-1][1])


def make_facts_training_dialogue(rng: random.Random) -> Dialogue:
    """A training dialogue: as `make_facts_dialogue`, a `SHARED_KINDS_SHARE` of them with
    `shared_kinds` (where a model that matches the kind of fact asked and not the name
    answers wrong)."""
    return make_facts_dialogue(rng, shared_kinds=rng.random() < SHARED_KINDS_SHARE)
