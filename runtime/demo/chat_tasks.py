"""Multi-turn chat whose later turns refer to earlier ones.

- A word problem of one or two steps, then one or two follow-ups ("Then Mia gives away
  4. How many pens does Mia have now?") worked from the previous answer;
- the user says things about themselves (name, city, pets, a number), the assistant
  acknowledges, and a later question asks for one of them back, or for the number
  with something added to it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from sprig.runtime.demo import words
from sprig.runtime.demo.dialogue import Dialogue, Message, assistant, user
from sprig.runtime.demo.tasks import make_problem, step

_PETS = ["cats", "dogs", "fish", "birds", "rabbits"]


def follow_up_dialogue(rng: random.Random) -> Dialogue:
    """A short word problem, then follow-ups that continue from its answer."""
    problem = make_problem(rng, max_steps=2)
    messages: list[Message] = [user(problem.question), assistant(problem.solution)]
    value = problem.answer
    for _ in range(1 if rng.random() < 0.8 else 2):
        s = step(rng, value)
        ask = rng.choice([f"How many {problem.item} does {problem.name} have now?", "How many now?"])
        messages += [user(f"Then {problem.name} {s.sentence}. {ask}"),
                     assistant("\n".join([*s.equations, f"Answer: {s.value}"]))]
        value = s.value
    return Dialogue("multi-turn", tuple(messages), f"Answer: {value}")


def recall_dialogue(rng: random.Random) -> Dialogue:
    """Facts about the user, an acknowledgement, and a question about one of them."""
    name, city = words.first_name(rng), rng.choice(words.CITIES)
    pets, count, number = rng.choice(_PETS), rng.randint(2, 9), rng.randint(2, 99)
    color = rng.choice(words.COLORS)
    said = {
        "name": (f"My name is {name}.", "What is my name?", f"Your name is {name}."),
        "city": (f"I live in {city}.", "Where do I live?", f"You live in {city}."),
        "pets": (f"I have {count} {pets}.", f"How many {pets} do I have?", f"You have {count} {pets}."),
        "color": (f"My favorite color is {color}.", "What is my favorite color?", f"Your favorite color is {color}."),
        "number": (f"My lucky number is {number}.", "What is my lucky number?", f"Your lucky number is {number}."),
    }
    told = rng.sample(list(said), rng.randint(1, 3))
    ack = f"Nice to meet you, {name}!" if "name" in told else rng.choice(["Got it.", "Noted.", "I will remember that."])
    messages: list[Message] = [user(" ".join(said[k][0] for k in told)), assistant(ack)]
    asked = rng.choice(told)
    if asked == "number" and rng.random() < 0.5:
        k = rng.randint(1, 20)
        answer = f"{number} + {k} = {number + k}\nAnswer: {number + k}"
        messages += [user(f"What is my lucky number plus {k}?"), assistant(answer)]
        return Dialogue("multi-turn", tuple(messages), f"Answer: {number + k}")
    messages += [user(said[asked][1]), assistant(said[asked][2])]
    return Dialogue("multi-turn", tuple(messages), said[asked][2])


KINDS: dict[Callable[[random.Random], Dialogue], float] = {follow_up_dialogue: 0.6, recall_dialogue: 0.4}


def make_chat_dialogue(rng: random.Random) -> Dialogue:
    """One multi-turn dialogue, of a kind drawn by `KINDS`' weights."""
    return rng.choices(list(KINDS), weights=list(KINDS.values()))[0](rng)
