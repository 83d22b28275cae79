"""JSON extraction: pydantic models give the schemas, the output is constrained to them
(`gen(json_schema=...)`), so every answer parses and validates; the model reads the values
out of the text.

    python examples/json_extraction.py [--url URL | --model PATH]
"""

from __future__ import annotations

import json

from _backend import backend, parser
from pydantic import BaseModel

import sprig


class Person(BaseModel):
    name: str
    age: int
    city: str


class Book(BaseModel):
    title: str
    author: str
    year: int
    pages: int


class Order(BaseModel):
    customer: str
    item: str
    quantity: int
    price: int


TEXTS: list[tuple[type[BaseModel], str]] = [
    (Person, "Tara Costa is 29 years old. Tara lives in Oslo. Tara likes chess."),
    (Book, "The Silent River was written by Kofi Meyer in 1987. It has 312 pages."),
    (Order, "Sam Novak ordered 12 lamps on Friday. Each one cost 45 dollars."),
]


@sprig.function
def extract(s, schema: str, text: str):
    s += sprig.system(f"Reply with a JSON object that matches this schema:\n{schema}")
    s += sprig.user(text)
    s += sprig.assistant(sprig.gen("record", max_tokens=96, json_schema=schema, temperature=0))


def main() -> None:
    args = parser(__doc__).parse_args()
    with backend(args):
        states = extract.run_batch([{"schema": json.dumps(model.model_json_schema()), "text": text}
                                    for model, text in TEXTS], progress_bar=False)
    for (model, text), state in zip(TEXTS, states, strict=True):
        print(f"{text}\n  -> {model.model_validate_json(state['record'])!r}")


if __name__ == "__main__":
    main()
