"""Streaming chat: a multi-turn conversation whose second turn refers to the first, each
reply printed as it is generated.

    python examples/streaming_chat.py [--url URL | --model PATH]
"""

from __future__ import annotations

from _backend import backend, parser

import sprig

TURNS = ["My name is Kofi. My lucky number is 17.", "What is my lucky number plus 5?"]


@sprig.function
def chat(s, turns: list[str]):
    for i, turn in enumerate(turns):
        s += sprig.user(turn)
        s += sprig.assistant(sprig.gen(f"reply_{i}", max_tokens=96, temperature=0))


def main() -> None:
    args = parser(__doc__).parse_args()
    with backend(args):
        state = chat.run(turns=TURNS, stream=True)
        for i, turn in enumerate(TURNS):
            print(f"user: {turn}\nassistant: ", end="", flush=True)
            for piece in state.text_iter(f"reply_{i}"):
                print(piece, end="", flush=True)
            print()


if __name__ == "__main__":
    main()
