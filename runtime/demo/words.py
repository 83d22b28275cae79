"""Word pools the demo tasks draw from, and made-up names.

Most names come from a fixed pool (whole tokens to a trained tokenizer); `person` also
makes up names from syllables, so that a model trained on the tasks copies any name it
reads rather than recognising a few.
"""

from __future__ import annotations

import random

FIRST_NAMES = [
    "Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kim", "Leo",
    "Mia", "Ned", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wes",
    "Yara", "Zoe", "Alma", "Boris", "Chen", "Dina", "Emil", "Frida", "Hugo", "Iris",
    "Jonas", "Kofi", "Lena", "Marco", "Nora", "Olga", "Pedro", "Ravi", "Sara", "Theo",
]
LAST_NAMES = [
    "Lopez", "Smith", "Novak", "Kim", "Rossi", "Berg", "Okafor", "Silva", "Meyer", "Tanaka",
    "Haddad", "Costa", "Fischer", "Moreau", "Jensen", "Ivanova", "Patel", "Nguyen",
]
CITIES = [
    "Oslo", "Lima", "Rome", "Cairo", "Paris", "Tokyo", "Berlin", "Madrid", "Dublin", "Lagos",
    "Seoul", "Quito", "Vienna", "Prague", "Lisbon", "Nairobi", "Boston", "Denver", "Austin",
    "Porto", "Milan", "Kyoto", "Delhi", "Sydney", "Toronto", "Havana", "Athens", "Riga",
]
JOBS = [
    "teacher", "nurse", "baker", "pilot", "farmer", "doctor", "painter", "chef", "lawyer",
    "dentist", "plumber", "writer", "singer", "driver", "tailor", "engineer",
]
HOBBIES = [
    "chess", "tennis", "jazz", "hiking", "cooking", "painting", "golf", "swimming",
    "reading", "dancing", "fishing", "cycling", "poetry", "karate", "gardening", "surfing",
]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "gray"]
ANIMALS = ["dog", "cat", "parrot", "rabbit", "horse", "turtle", "hamster", "goat"]
PET_NAMES = ["Rex", "Luna", "Max", "Bella", "Coco", "Milo", "Nala", "Otto", "Pip", "Ziggy"]
GOODS = [
    "pen", "book", "lamp", "chair", "kettle", "jacket", "clock", "basket", "candle", "ladder",
    "mirror", "teapot", "blanket", "wallet", "helmet", "guitar",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WEATHER = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "stormy", "clear"]
TITLE_WORDS = [
    "Silent", "River", "Golden", "Garden", "Winter", "Night", "Stone", "Song", "Hidden",
    "Harbor", "Last", "Light", "Paper", "Moon", "Iron", "Forest", "Glass", "Road",
]
_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]


def made_up_name(rng: random.Random) -> str:
    """A pronounceable name of two or three syllables, capitalised."""
    syllables = rng.randint(2, 3)
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)).capitalize()


def first_name(rng: random.Random) -> str:
    """A first name: from the pool, or made up one time in five."""
    return made_up_name(rng) if rng.random() < 0.2 else rng.choice(FIRST_NAMES)


def person(rng: random.Random) -> str:
    """A first name, with a last name half of the time."""
    name = first_name(rng)
    return f"{name} {rng.choice(LAST_NAMES)}" if rng.random() < 0.5 else name


def distinct(rng: random.Random, draw, n: int) -> list:
    """`n` different values from `draw(rng)`."""
    out: list = []
    while len(out) < n:
        value = draw(rng)
        if value not in out:
            out.append(value)
    return out


def article(noun: str) -> str:
    """`a noun` or `an noun`, by the noun's first letter."""
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def join_words(words: list[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
