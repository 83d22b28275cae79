"""Streaming chat: a multi-turn conversation whose replies print as they are generated.

    python examples/streaming_chat.py [--url URL | --model PATH]
"""

from __future__ import annotations

from _backend import backend, parser

import sprig

TURNS = [
    "Mia has 8 pens. Then Mia buys 5 more. How many pens does Mia have now?",
    "Ned has 30 coins. Then Ned gives away 11. How many coins does Ned have now?",
]


@sprig.function
def chat(s, turns: list[str]):
    for i, turn in enumerate(turns):
        s += sprig.user(turn)
        s += sprig.assistant(sprig.gen(f"reply_{i}", max_tokens=160, temperature=0))


def main() -> None:
    args = parser(__doc__).parse_args()
    with backend(args):
        state = chat.run(turns=TURNS, stream=True)
        for i, turn in enumerate(TURNS):
            print(f"user: {turn}\nassistant: ", end="", flush=True)
            for piece in state.text_iter(f"reply_{i}"):
                print(piece, end="", flush=True)
            print()
        print(f"\n{len(state.messages())} messages")


if __name__ == "__main__":
    main()
