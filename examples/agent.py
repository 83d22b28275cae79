"""A tool-using agent loop: the model writes a calculator call under a regex constraint,
the program runs the tool and hands the result back as a tool message, until the model
gives a final answer.

    python examples/agent.py [--url URL | --model PATH]
"""

from __future__ import annotations

import re

from _backend import backend, parser

import sprig

TASK = "Ivan has 14 coins. Ivan buys 9 more. Then Ivan shares them equally with Jo. How many coins does Ivan have?"
CALL = r"calc\((-?[0-9]{1,3}) ?[-+*/] ?(-?[0-9]{1,3})\)|Answer: -?[0-9]{1,3}"


def calculator(call: str) -> str:
    """Run `calc(a op b)`; integer division, and division by zero is an error message."""
    a, op, b = re.fullmatch(r"calc\((-?\d+) ?([-+*/]) ?(-?\d+)\)", call).groups()
    x, y = int(a), int(b)
    if op == "/" and y == 0:
        return "error: division by zero"
    return str({"+": x + y, "-": x - y, "*": x * y, "/": x // y if y else 0}[op])


@sprig.function
def agent(s, task: str, max_turns: int = 4):
    s += sprig.system("Use calc(a op b) for arithmetic, then reply 'Answer: N'.")
    s += sprig.user(task)
    for turn in range(max_turns):
        s += sprig.assistant(sprig.gen(f"action_{turn}", max_tokens=16, regex=CALL, temperature=0))
        action = s[f"action_{turn}"]
        if action.startswith("Answer:"):
            return action
        s += sprig.user(f"tool result: {calculator(action)}")
    return None


def main() -> None:
    args = parser(__doc__).parse_args()
    with backend(args):
        state = agent.run(task=TASK)
    for message in state.messages():
        print(f"{message['role']:>9}: {message['content']}")
    print(f"\nfinal: {state.ret_value}")


if __name__ == "__main__":
    main()
