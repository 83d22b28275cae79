"""JSON extraction: the output is constrained to a JSON schema, so it always parses and
validates — even from a small model.

    python examples/json_extraction.py [--url URL | --model PATH]
"""

from __future__ import annotations

import json

from _backend import backend, parser

import sprig

SCHEMA = {
    "type": "object",
    "properties": {
        "person": {"type": "string", "maxLength": 12},
        "item": {"enum": ["apples", "books", "coins", "marbles", "pens", "stamps", "cards", "shells"]},
        "start": {"type": "integer", "minimum": 0, "maximum": 199},
    },
    "required": ["person", "item", "start"],
}
TEXTS = [
    "Kim has 15 shells. Kim buys 3 more.",
    "Leo has 40 books. Leo gives away 12.",
]


@sprig.function
def extract(s, text: str):
    s += sprig.user(f"Extract who, what and how many at the start, as JSON.\n{text}")
    s += sprig.assistant(sprig.gen("record", max_tokens=64, json_schema=json.dumps(SCHEMA), temperature=0))


def main() -> None:
    args = parser(__doc__).parse_args()
    with backend(args):
        states = extract.run_batch([{"text": t} for t in TEXTS], progress_bar=False)
    for text, state in zip(TEXTS, states, strict=True):
        print(f"{text}\n  -> {json.loads(state['record'])}")


if __name__ == "__main__":
    main()
