"""What constraining `tool_choice: "auto"` after the tool-call marker gives and costs.

1. Calls: the demo model, offered one tool (`add`), answers each question with `--seeds`
   seeds at temperature 1, as the server's chat route asks it: once with the calls
   constrained after `<tool_call>` (`constraint_trigger`, what the server sends), once
   unconstrained (what it sent before). Each answer is parsed as the server parses it:
   calls of `add` with valid arguments, plain content, or a broken call (the marker, then
   no well-formed call of an offered tool: the client gets that text as content).
2. Compile: the grammar of 1 to 6 tools compiled cold (what the first request of a tool
   set waits for; later ones hit the cache) by outlines-core as a regex, and by llguidance
   as that regex in a Lark grammar (what the server sends where llguidance drives the
   tokenizer), with the demo model's tokenizer and a `--vocab`-token byte-level BPE
   trained on the standard library.

    python benchmarks/bench_auto_tool_calls.py [--seeds 12] [--vocab 100000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jsonschema
from bench_grammar_backends import stdlib_tokenizer
from transformers import AutoTokenizer

from sprig.runtime import Engine
from sprig.runtime.constrained import GrammarSpec, GuidanceBackend, OutlinesBackend
from sprig.runtime.constrained.regex_text import lark_grammar
from sprig.runtime.demo import ensure_demo_model
from sprig.runtime.server.tool_calls import FORMATS, plan_tool_use


def tool(name: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TEXT, NUMBER = {"type": "string"}, {"type": "number"}
ADD = tool("add", {"a": NUMBER, "b": NUMBER}, ["a", "b"])
TOOLS = [ADD, tool("get_weather", {"city": TEXT, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
         tool("get_time", {}, []), tool("search", {"query": TEXT, "limit": {"type": "integer"}}, ["query"]),
         tool("send_email", {"to": TEXT, "subject": TEXT, "body": TEXT, "cc": {"type": "array", "items": TEXT}},
              ["to", "subject", "body"]),
         tool("book_flight", {"origin": TEXT, "destination": TEXT, "date": TEXT, "seats": {"type": "integer"}},
              ["origin", "destination", "date"])]
QUESTIONS = ["What is 14 plus 9?", "Add 3 and 4.", "What is the price of a lamp?", "Who is Tara?"]


def kind(text: str, names: frozenset[str]) -> str:
    _, calls = FORMATS["hermes"].split(text, True, names)
    if calls:
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), ADD["function"]["parameters"])
        return "calls"
    return "broken" if "<tool_call>" in text else "content"


def calls(model: Path, seeds: int) -> None:
    tok = AutoTokenizer.from_pretrained(model)
    plan = plan_tool_use([ADD], "auto", FORMATS["hermes"], None)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tools=[ADD], add_generation_prompt=True,
                                       tokenize=False) for q in QUESTIONS]
    base = {"max_new_tokens": 200, "temperature": 1.0}
    gated = {**base, "regex": plan.regex, "constraint_trigger": plan.trigger}
    with Engine(model) as engine:
        for label, params in (("constrained after <tool_call>", gated), ("unconstrained", base)):
            texts = [prompt for prompt in prompts for _ in range(seeds)]
            outs = engine.generate(texts, [{**params, "seed": s} for _ in prompts for s in range(seeds)])
            counts = {"calls": 0, "content": 0, "broken": 0}
            for out in outs:
                counts[kind(out["text"], plan.names)] += 1
            print(f"{label:>31}: {counts['calls']} calls of add, {counts['content']} content, "
                  f"{counts['broken']} broken, of {len(outs)}")


def compiles(tokenizer: Path, label: str) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer)
    outlines, guidance = OutlinesBackend.from_tokenizer(tok), GuidanceBackend.from_tokenizer(tok)
    for backend, spec in ((outlines, GrammarSpec.regex), (guidance, lambda r: GrammarSpec("ebnf", lark_grammar(r)))):
        backend.prepare(backend.compile(spec("warm")))
        times = []
        for n in (1, 2, 4, 6):
            regex = FORMATS["hermes"].after_trigger(TOOLS[:n], True)
            start = time.perf_counter()
            backend.prepare(backend.compile(spec(regex)))
            times.append(f"{n} tools {time.perf_counter() - start:.3f} s")
        name = "outlines-core, a regex" if backend is outlines else "llguidance, the regex as Lark (the server's)"
        print(f"compile, {label}, {name}: " + ", ".join(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=12, help="seeds per question")
    parser.add_argument("--vocab", type=int, default=100000, help="the large tokenizer's vocabulary size")
    args = parser.parse_args()
    model = ensure_demo_model()
    calls(model, args.seeds)
    compiles(model, "the demo model's tokenizer")
    with tempfile.TemporaryDirectory() as root:
        compiles(stdlib_tokenizer(Path(root), args.vocab), f"a {args.vocab}-token BPE")


if __name__ == "__main__":
    main()
