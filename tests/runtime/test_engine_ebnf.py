"""EBNF grammars (SGLang's `ebnf`) through the engine: sampled outputs, with jump-forward on
and off, are sentences of their grammar, checked by a recursive-descent parser written for
each test grammar; GBNF and Lark spellings of one grammar enforce the same language; a
grammar that does not compile fails only its request."""

from __future__ import annotations

import pytest
from engine_helpers import assert_idle_and_intact

from sprig.runtime import Engine

# nested arrays of small integers: context-free (brackets must balance at any depth)
ARRAYS_GBNF = r"""
root ::= array
array ::= "[" ( value ( "," value )* )? "]"
value ::= [0-9] [0-9]? | array
"""
ARRAYS_LARK = r"""
start: array
array: "[" (value ("," value)*)? "]"
value: /[0-9][0-9]?/ | array
"""
# fixed words around free ones: jump-forward has text to force
SENTENCE_GBNF = r"""
root ::= "the " animal " said " quote " to the " animal "."
animal ::= "cat" | "dog" | "fox"
quote ::= "\"" [a-z]{1,8} ( " " [a-z]{1,8} ){0,2} "\""
"""


class Parser:
    """A cursor over `text`; every method consumes what it names or raises ValueError."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def take(self, literal: str) -> None:
        if not self.text.startswith(literal, self.pos):
            raise ValueError(f"expected {literal!r} at {self.pos} of {self.text!r}")
        self.pos += len(literal)

    def peek(self, literal: str) -> bool:
        return self.text.startswith(literal, self.pos)

    def chars(self, allowed: str, least: int, most: int) -> str:
        start = self.pos
        while self.pos < len(self.text) and self.pos - start < most and self.text[self.pos] in allowed:
            self.pos += 1
        if self.pos - start < least:
            raise ValueError(f"expected {least}+ of {allowed!r} at {start} of {self.text!r}")
        return self.text[start : self.pos]

    def end(self) -> None:
        if self.pos != len(self.text):
            raise ValueError(f"trailing text at {self.pos} of {self.text!r}")


def parse_array(p: Parser) -> int:
    """Consume an array; its nesting depth."""
    p.take("[")
    depth = 0
    if not p.peek("]"):
        depth = parse_value(p)
        while p.peek(","):
            p.take(",")
            depth = max(depth, parse_value(p))
    p.take("]")
    return depth + 1


def parse_value(p: Parser) -> int:
    if p.peek("["):
        return parse_array(p)
    p.chars("0123456789", 1, 2)
    return 0


def check_arrays(text: str) -> int:
    p = Parser(text)
    depth = parse_array(p)
    p.end()
    return depth


def check_sentence(text: str) -> None:
    p = Parser(text)
    animals = ("cat", "dog", "fox")
    p.take("the ")
    p.take(next((a for a in animals if p.peek(a)), "cat"))
    p.take(' said "')
    p.chars("abcdefghijklmnopqrstuvwxyz", 1, 8)
    for _ in range(2):
        if not p.peek(" "):
            break
        p.take(" ")
        p.chars("abcdefghijklmnopqrstuvwxyz", 1, 8)
    p.take('" to the ')
    p.take(next((a for a in animals if p.peek(a)), "cat"))
    p.take(".")
    p.end()


def test_the_checkers_refuse_what_the_grammars_refuse() -> None:
    assert check_arrays("[1,[2,[]],34]") == 3
    for bad in ("[1,]", "[[1]", "[123]", "[1][2]", "[]]"):
        with pytest.raises(ValueError):
            check_arrays(bad)
    check_sentence('the cat said "hi there" to the fox.')
    for bad in ('the cow said "hi" to the fox.', 'the cat said "" to the fox.', 'the cat said "hi" to the fox'):
        with pytest.raises(ValueError):
            check_sentence(bad)


@pytest.fixture(scope="module", params=[True, False], ids=["jump", "no-jump"])
def engine(request, tiny_llama):
    with Engine(tiny_llama, dtype="float32", check_integrity=True, enable_jump_forward=request.param,
                grammar_compile_timeout_s=20) as eng:
        yield eng


def sampled(engine: Engine, n: int, **params) -> list[dict]:
    prompts = [f"sample {i}:" for i in range(n)]
    outs = engine.generate(prompts, [{"max_new_tokens": 160, "temperature": 1.0, **params, "seed": i}
                                     for i in range(n)])
    assert_idle_and_intact(engine)
    return outs


@pytest.mark.parametrize("grammar", [ARRAYS_GBNF, ARRAYS_LARK], ids=["gbnf", "lark"])
def test_outputs_are_sentences_of_a_context_free_grammar(engine, grammar) -> None:
    outs = sampled(engine, 12, ebnf=grammar)
    depths = []
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        depths.append(check_arrays(out["text"]))
    assert max(depths) >= 2  # the outputs nest: the grammar's recursion is exercised


def test_forced_text_around_free_text(engine) -> None:
    for out in sampled(engine, 6, ebnf=SENTENCE_GBNF):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        check_sentence(out["text"])


def test_jump_forward_appends_forced_text_without_steps(tiny_llama) -> None:
    for jump in (True, False):
        with Engine(tiny_llama, dtype="float32", enable_jump_forward=jump) as eng:
            params = {"ebnf": SENTENCE_GBNF, "max_new_tokens": 80, "temperature": 0}
            eng.generate("warm up:", params)  # compile outside the measured call
            stats = eng.scheduler.stats
            steps, jumped = stats.decode_steps, stats.jump_forward_tokens
            out = eng.generate("story:", params)
            check_sentence(out["text"])
            steps, jumped = stats.decode_steps - steps, stats.jump_forward_tokens - jumped
            tokens = out["meta_info"]["completion_tokens"]
            if jump:  # " said \"", "\" to the " and "." are forced
                assert jumped >= 3 and steps <= tokens - jumped, (out, steps, jumped)
            else:
                assert jumped == 0 and steps == tokens - 1, (out, steps)  # the first token comes from the prefill


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ('root ::= "a" missing', "Rule 'missing' not found"),
        ('expr ::= "a"', "No 'root' rule found"),
        ("start: /[/", "unclosed character class"),
        ('root ::= "a" (', "invalid ebnf grammar"),
    ],
)
def test_a_grammar_that_does_not_compile_fails_only_its_request(engine, grammar, message) -> None:
    outs = engine.generate(["bad", "good"], [{"ebnf": grammar}, {"max_new_tokens": 3, "ignore_eos": True}])
    reason = outs[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400, reason
    assert "ebnf" in reason["message"] and message in reason["message"], reason
    assert outs[1]["meta_info"]["completion_tokens"] == 3
    assert_idle_and_intact(engine)
