"""JSON extraction: read a short text about a person, an order, a book or a meeting, and
answer a JSON object with the fields a schema asks for.

A schema asks for two or more of a domain's fields, in random order, under one of the
names such a field goes by (`name`, `full_name`, ...), with plain types (string,
integer, list of strings) and no bounds — written as pydantic writes one (titles) or
plainly. The prompt gives the schema in the user's turn or in a system turn, or only
names the fields. The answer lists the fields in the schema's order, spaced as
`json.dumps` writes them (so a number is the same tokens in the answer as in the text).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sprig.runtime.demo import words
from sprig.runtime.demo.dialogue import Dialogue, Message, assistant, system, user

_TOPICS = ["budget", "launch", "hiring", "design", "sales", "safety"]
_JSON_TYPES = {"string": {"type": "string"}, "integer": {"type": "integer"},
               "strings": {"type": "array", "items": {"type": "string"}}}


@dataclass(frozen=True)
class Domain:
    """What a text is about: its fields (canonical name -> (kind, names a schema may use)),
    how a record is drawn, and the texts that state one."""

    title: str
    noun: str
    fields: dict[str, tuple[str, tuple[str, ...]]]
    draw: Callable[[random.Random], dict[str, Any]]
    texts: Callable[[random.Random, dict[str, Any]], str]


def _person(rng: random.Random) -> dict[str, Any]:
    hobbies = words.distinct(rng, lambda r: r.choice(words.HOBBIES), rng.randint(1, 3))
    return {"name": words.person(rng), "age": rng.randint(18, 90), "city": rng.choice(words.CITIES),
            "job": rng.choice(words.JOBS), "hobbies": hobbies}


def _person_text(rng: random.Random, r: dict[str, Any]) -> str:
    first = r["name"].split()[0]
    if rng.random() < 0.25:
        return (f"{r['name']}, {r['age']}, is {words.article(r['job'])} from {r['city']} who likes "
                f"{words.join_words(r['hobbies'])}.")
    opening = rng.choice([f"{r['name']} is {r['age']} years old.", f"{r['name']} is {r['age']}."])
    rest = [
        rng.choice([f"{first} lives in {r['city']}.", f"{first} is from {r['city']}."]),
        rng.choice([f"{first} works as {words.article(r['job'])}.", f"{first} is {words.article(r['job'])}."]),
        rng.choice([f"{first} likes {words.join_words(r['hobbies'])}.",
                    f"{first} enjoys {words.join_words(r['hobbies'])}."]),
    ]
    rng.shuffle(rest)
    return " ".join([opening, *rest])


def _order(rng: random.Random) -> dict[str, Any]:
    return {"customer": words.person(rng), "item": rng.choice(words.GOODS), "quantity": rng.randint(2, 40),
            "price": rng.randint(2, 300), "day": rng.choice(words.DAYS)}


def _order_text(rng: random.Random, r: dict[str, Any]) -> str:
    return rng.choice([
        f"{r['customer']} ordered {r['quantity']} {r['item']}s on {r['day']}. Each one cost {r['price']} dollars.",
        f"On {r['day']}, {r['customer']} bought {r['quantity']} {r['item']}s at {r['price']} dollars each.",
    ])


def _book(rng: random.Random) -> dict[str, Any]:
    title = "The " + " ".join(words.distinct(rng, lambda r: r.choice(words.TITLE_WORDS), 2))
    author = f"{words.first_name(rng)} {rng.choice(words.LAST_NAMES)}"
    return {"title": title, "author": author, "year": rng.randint(1900, 2024), "pages": rng.randint(80, 900)}


def _book_text(rng: random.Random, r: dict[str, Any]) -> str:
    return rng.choice([
        f"{r['title']} was written by {r['author']} in {r['year']}. It has {r['pages']} pages.",
        f"{r['author']} published {r['title']} in {r['year']}; the book has {r['pages']} pages.",
    ])


def _meeting(rng: random.Random) -> dict[str, Any]:
    people = words.distinct(rng, words.first_name, rng.randint(2, 4))
    return {"topic": rng.choice(_TOPICS), "day": rng.choice(words.DAYS), "room": rng.randint(100, 999),
            "attendees": people}


def _meeting_text(rng: random.Random, r: dict[str, Any]) -> str:
    return rng.choice([
        f"The {r['topic']} meeting is on {r['day']} in room {r['room']}. "
        f"{words.join_words(r['attendees'])} will attend.",
        f"{words.join_words(r['attendees'])} meet on {r['day']} in room {r['room']} to talk about {r['topic']}.",
    ])


DOMAINS = {
    "person": Domain("Person", "person", {
        "name": ("string", ("name", "full_name", "person")), "age": ("integer", ("age",)),
        "city": ("string", ("city", "home_city")), "job": ("string", ("job", "occupation")),
        "hobbies": ("strings", ("hobbies", "interests")),
    }, _person, _person_text),
    "order": Domain("Order", "order", {
        "customer": ("string", ("customer", "buyer")), "item": ("string", ("item", "product")),
        "quantity": ("integer", ("quantity", "count")), "price": ("integer", ("price", "unit_price")),
        "day": ("string", ("day",)),
    }, _order, _order_text),
    "book": Domain("Book", "book", {
        "title": ("string", ("title",)), "author": ("string", ("author", "writer")),
        "year": ("integer", ("year",)), "pages": ("integer", ("pages", "page_count")),
    }, _book, _book_text),
    "meeting": Domain("Meeting", "meeting", {
        "topic": ("string", ("topic",)), "day": ("string", ("day",)),
        "room": ("integer", ("room", "room_number")), "attendees": ("strings", ("attendees", "people")),
    }, _meeting, _meeting_text),
}


def schema_for(title: str, fields: list[tuple[str, str]], pydantic: bool) -> dict[str, Any]:
    """An object schema with `fields` ((name, kind) pairs) all required: as pydantic's
    `model_json_schema()` writes a model with those fields (the same text), or plainly."""
    if not pydantic:
        props = {name: dict(_JSON_TYPES[kind]) for name, kind in fields}
        return {"type": "object", "properties": props, "required": [n for n, _ in fields]}
    props = {}
    for name, kind in fields:
        spec = {"title": name.replace("_", " ").title(), **_JSON_TYPES[kind]}
        props[name] = {k: spec[k] for k in sorted(spec)}
    return {"properties": props, "required": [n for n, _ in fields], "title": title, "type": "object"}


def _prompt(rng: random.Random, domain: Domain, schema: dict[str, Any], names: list[str],
            text: str) -> list[Message]:
    shown = json.dumps(schema)
    style = rng.random()
    if style < 0.45:
        return [user(rng.choice([
            f"Extract the {domain.noun} from the text as JSON that matches this schema:\n{shown}\nText: {text}",
            f"Text: {text}\nReturn a JSON object that matches this schema:\n{shown}",
        ]))]
    if style < 0.8:
        return [system(f"Reply with a JSON object that matches this schema:\n{shown}"), user(text)]
    return [user(f"{text}\nGive the {words.join_words(names)} as JSON.")]


def make_extraction_dialogue(rng: random.Random) -> Dialogue:
    """One extraction: a text, a schema over some of its fields, the JSON answer."""
    domain = DOMAINS[rng.choice(list(DOMAINS))]
    record = domain.draw(rng)
    chosen = rng.sample(list(domain.fields), rng.randint(2, len(domain.fields)))
    names = [domain.fields[f][1][0] if rng.random() < 0.6 else rng.choice(domain.fields[f][1]) for f in chosen]
    schema = schema_for(domain.title, [(n, domain.fields[f][0]) for n, f in zip(names, chosen, strict=True)],
                        pydantic=rng.random() < 0.5)
    answer = {n: record[f] for n, f in zip(names, chosen, strict=True)}
    text = json.dumps(answer)
    messages = [*_prompt(rng, domain, schema, names, domain.texts(rng, record)), assistant(text)]
    return Dialogue("json", tuple(messages), json.dumps(answer), schema=schema)
