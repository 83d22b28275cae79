"""The copying warm-up of the demo model's training: "Repeat: w1 w2 ..." answered with the
same words.

Every task of the mixture answers by copying something from its prompt (a name from the
facts, a value into JSON, an argument into a tool call), and a small model learns to copy
late: trained on the mixture alone, its first hundreds of steps learn which words occur
in the prompt but not which one comes next. A few hundred cheap steps of copying short
lists (two to five words, names made up and numbers included) teach that first, and the
mixture's tasks then learn to use it (the training script's `copy_steps`).
"""

from __future__ import annotations

import random

from sprig.runtime.demo import words
from sprig.runtime.demo.dialogue import Dialogue, assistant, stream, user
from sprig.runtime.demo.tasks import Split

_POOLS = (words.CITIES, words.JOBS, words.COLORS, words.ANIMALS, words.GOODS, words.FIRST_NAMES, words.DAYS)


def _word(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return words.made_up_name(rng)
    if kind == 1:
        return str(rng.randint(1, 999))
    return rng.choice(rng.choice(_POOLS))


def make_copy_dialogue(rng: random.Random) -> Dialogue:
    """Two to five words to repeat, in order, separated by single spaces."""
    text = " ".join(_word(rng) for _ in range(rng.randint(2, 5)))
    return Dialogue("copy", (user(f"Repeat: {text}"), assistant(text)), text)


def take_copies(split: Split, n: int, seed: int = 0) -> list[Dialogue]:
    """The first `n` distinct copying dialogues of `split`."""
    it = stream(make_copy_dialogue, split, seed, "copy")
    return [next(it) for _ in range(n)]
