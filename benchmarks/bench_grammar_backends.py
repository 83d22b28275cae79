"""The two grammar backends side by side: outlines-core (regex → token automaton) and
llguidance (Earley parser + lazy lexer over a token trie), on the same specs and the same
token paths.

For each spec and tokenizer:
1. Compile: a cold compile by each backend, as the server does it (outlines: spec → regex
   → token index; llguidance: spec → grammar, checked by building a matcher, then the
   template matcher `prepare` builds). Runs alternate between the backends `--repeats`
   times; medians.
2. Masks: one token path per spec (a seeded random walk through the outlines matcher's
   masks, up to `--path-tokens` tokens, ending on a stop token where the grammar allows),
   replayed through a fresh matcher of each backend: time per token of `fill_bitmask`
   and of `accept_token`, medians over alternating replays. Every replay must accept every
   token of the path (the path is valid for both), and the two backends' masks are
   compared at every step (tokens outlines cannot use by construction are left out:
   `TokenVocabulary.outlines`): llguidance must never allow a token outlines forbids; it
   allows fewer where the text is forced (only the canonical tokens of the forced text).
3. EBNF (llguidance only: outlines-core has no context-free grammars): compile time and
   mask time on an arithmetic-expression grammar and a JSON-like grammar.

`--free-form` instead compiles the JSON schemas with free-form JSON in them (what the
grammar router sends to llguidance whatever `--grammar-backend` says) once by each
backend, and prints the compile times: outlines-core's take minutes on the largest.

Tokenizers: the tests' 512-token BPE, and a 32,000-token byte-level BPE trained here on
the Python standard library's source (a minute or less), or `--tokenizer PATH` (any local
Hugging Face tokenizer directory).

    python benchmarks/bench_grammar_backends.py
    python benchmarks/bench_grammar_backends.py --tokenizer PATH --repeats 7
    python benchmarks/bench_grammar_backends.py --free-form
"""

from __future__ import annotations

import argparse
import random
import statistics
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_constrained import FIXED_KEYS, RECORD, growing_schema

from sprig.kernels.logit_mask import unpack_bitmask
from sprig.runtime.constrained import (
    Grammar,
    GrammarSpec,
    GuidanceBackend,
    OutlinesBackend,
    bitmask_width,
)
from sprig.runtime.constrained.spec_regex import spec_regex
from sprig.runtime.constrained.vocabulary import END_MARK
from sprig.runtime.tiny_checkpoint import build_tokenizer
from sprig.runtime.tokenizer import load_tokenizer

SPECS: dict[str, GrammarSpec] = {
    "regex int": GrammarSpec.regex(r"-?(0|[1-9][0-9]{0,8})"),
    "regex decimal": GrammarSpec.regex(r"-?(0|[1-9][0-9]{0,3})\.[0-9]{2}"),
    "regex words": GrammarSpec.regex(r"[a-z]{3,8}( [a-z]{2,5}){0,12}\."),
    "regex email": GrammarSpec.regex(r"[a-z0-9._]{1,20}@[a-z0-9]{1,12}\.(com|org|net)"),
    "choices 4": GrammarSpec.choices(["positive", "negative", "neutral", "mixed feelings"]),
    "json RECORD": GrammarSpec.json_schema(RECORD),
    "json FIXED_KEYS": GrammarSpec.json_schema(FIXED_KEYS),
    "json 10 string props": GrammarSpec.json_schema(growing_schema(10)),
    "json 30 string props": GrammarSpec.json_schema(growing_schema(30)),
}
FREE_FORM: dict[str, GrammarSpec] = {
    "json_object": GrammarSpec.json_schema({"type": "object"}),
    "an array with no items": GrammarSpec.json_schema({"type": "array"}),
    "a property of any value": GrammarSpec.json_schema(
        {"type": "object", "properties": {"id": {"type": "integer"}, "data": {}}, "required": ["id", "data"]}),
    "any value ({})": GrammarSpec.json_schema({}),
}
EBNF = {
    "ebnf arithmetic": GrammarSpec.ebnf(
        'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
        'factor ::= [0-9]{1,4} | "(" expr ")"\n'
    ),
    "ebnf json-like": GrammarSpec.ebnf(
        'root ::= value\nvalue ::= object | array | string | number | "true" | "false" | "null"\n'
        'object ::= "{" (string ":" value ("," string ":" value)*)? "}"\n'
        'array ::= "[" (value ("," value)*)? "]"\nstring ::= "\\"" [a-z ]{0,16} "\\""\n'
        'number ::= "-"? [0-9]{1,6}\n'
    ),
}


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def stdlib_tokenizer(root: Path, vocab_size: int = 32000) -> Path:
    """A byte-level BPE trained on the standard library's Python source, saved as a
    `PreTrainedTokenizerFast` under `root`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:4000]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((f.read_text(errors="replace") for f in files), trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(str(root))
    return root


def allowed(grammar: Grammar, width: int) -> torch.Tensor:  # [width] bool
    row = torch.zeros(bitmask_width(width), dtype=torch.int32)
    grammar.fill_bitmask(row)
    return unpack_bitmask(row[None], width)[0]


def random_path(grammar: Grammar, width: int, max_tokens: int, rng: random.Random, eos: int) -> list[int]:
    """Up to `max_tokens` tokens drawn uniformly from each step's mask; EOS, where
    allowed, with probability 1/16 (it ends the path)."""
    path: list[int] = []
    while not grammar.is_finished() and len(path) < max_tokens:
        ids = allowed(grammar, width).nonzero().flatten().tolist()
        choices = [t for t in ids if t != eos]
        token = eos if eos in ids and (not choices or rng.random() < 1 / 16) else rng.choice(choices)
        assert grammar.accept_token(token), token
        path.append(token)
    return path


def replay(make: Callable[[], Grammar], path: list[int], width: int) -> tuple[float, float, list[torch.Tensor]]:
    """(seconds in fill_bitmask, seconds in accept_token, the masks) along `path`."""
    grammar = make()
    row = torch.zeros(bitmask_width(width), dtype=torch.int32)
    fill_s = accept_s = 0.0
    masks = []
    for token in path:
        start = time.perf_counter()
        grammar.fill_bitmask(row)
        fill_s += time.perf_counter() - start
        masks.append(row.clone())
        start = time.perf_counter()
        ok = grammar.accept_token(token)
        accept_s += time.perf_counter() - start
        assert ok, f"the path's token {token} was refused"
    return fill_s, accept_s, masks


def compare(name: str, spec: GrammarSpec, backends: dict[str, Any], width: int, args: argparse.Namespace,
            rng: random.Random, outlines_usable: torch.Tensor) -> dict[str, Any]:
    compile_s: dict[str, list[float]] = {n: [] for n in backends}
    compiled: dict[str, Any] = {}
    for _ in range(args.repeats):
        for bname, backend in backends.items():
            start = time.perf_counter()
            compiled[bname] = backend.prepare(backend.compile(spec))
            compile_s[bname].append(time.perf_counter() - start)
    first = next(iter(backends))
    eos = load_eos(backends[first])
    path = random_path(backends[first].matcher(compiled[first]), width, args.path_tokens, rng, eos)
    fill: dict[str, list[float]] = {n: [] for n in backends}
    accept: dict[str, list[float]] = {n: [] for n in backends}
    masks: dict[str, list[torch.Tensor]] = {}
    for _ in range(args.repeats):
        for bname, backend in backends.items():
            f, a, masks[bname] = replay(lambda b=backend, n=bname: b.matcher(compiled[n]), path, width)
            fill[bname].append(f / len(path))
            accept[bname].append(a / len(path))
    wider = narrower = 0
    if len(backends) == 2:
        one, two = (unpack_bitmask(torch.stack(masks[n]), width) & outlines_usable for n in backends)
        wider = int((two & ~one).any(dim=1).sum())
        narrower = int((one & ~two).any(dim=1).sum())
    return {"name": name, "tokens": len(path), "wider": wider, "narrower": narrower,
            "compile": {n: median_ms(v) for n, v in compile_s.items()},
            "fill": {n: median_ms(v) * 1e3 for n, v in fill.items()},
            "accept": {n: median_ms(v) * 1e3 for n, v in accept.items()}}


def load_eos(backend: Any) -> int:
    return backend.vocabulary.eos_token_id if isinstance(backend, OutlinesBackend) else backend.eos_token_id


def run(tokenizer_path: Path, args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(tokenizer_path)
    width = len(tokenizer)
    start = time.perf_counter()
    outlines = OutlinesBackend.from_tokenizer(tokenizer)
    vocab_s = time.perf_counter() - start
    start = time.perf_counter()
    guidance = GuidanceBackend.from_tokenizer(tokenizer)
    guidance.tokenizer()
    lltok_s = time.perf_counter() - start
    mark = END_MARK.encode()
    usable = torch.tensor([t is not None and not t.endswith(tuple(mark[:n] for n in range(1, 5)))
                           for t in outlines.vocabulary.token_bytes] + [False] * (width - len(outlines.vocabulary)))
    usable[outlines.vocabulary.eos_token_id] = True
    print(f"\n## tokenizer {tokenizer_path.name}: {width:,} tokens\n")
    print(f"one-off per process: outlines vocabulary {vocab_s * 1e3:.0f} ms, llguidance tokenizer {lltok_s * 1e3:.0f} ms\n")
    if args.free_form:
        free_form_compiles(outlines, guidance)
        return
    print("| spec | path tokens | compile ms outlines | compile ms llguidance | outlines / llguidance "
          "| mask µs/token outlines | mask µs/token llguidance | outlines / llguidance "
          "| accept µs/token outlines | accept µs/token llguidance "
          "| steps llguidance allows more / fewer tokens |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rng = random.Random(args.seed)
    both = {"outlines": outlines, "llguidance": guidance}
    ratios: dict[str, list[float]] = {"compile": [], "fill": []}
    for name, spec in SPECS.items():
        r = compare(name, spec, both, width, args, rng, usable)
        c, f, a = r["compile"], r["fill"], r["accept"]
        for what in ratios:
            ratios[what].append(r[what]["outlines"] / r[what]["llguidance"])
        print(f"| {name} | {r['tokens']} | {c['outlines']:.1f} | {c['llguidance']:.1f} | "
              f"{c['outlines'] / c['llguidance']:.1f}x | {f['outlines']:.1f} | {f['llguidance']:.1f} | "
              f"{f['outlines'] / f['llguidance']:.2f}x | {a['outlines']:.1f} | {a['llguidance']:.1f} | "
              f"{r['wider']} / {r['narrower']} |")
    print(f"\nmedian over the specs, outlines / llguidance: compile {statistics.median(ratios['compile']):.1f}x, "
          f"mask {statistics.median(ratios['fill']):.2f}x")
    print("\n| ebnf (llguidance only) | path tokens | compile ms | mask µs/token | accept µs/token |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, spec in EBNF.items():
        r = compare(name, spec, {"llguidance": guidance}, width, args, rng, usable)
        print(f"| {name} | {r['tokens']} | {r['compile']['llguidance']:.1f} | {r['fill']['llguidance']:.1f} | "
              f"{r['accept']['llguidance']:.1f} |")


def free_form_compiles(outlines: OutlinesBackend, guidance: GuidanceBackend) -> None:
    """One compile of each `FREE_FORM` spec by each backend (seconds), in a table."""
    print("| free-form spec | regex chars | compile s outlines | compile s llguidance | outlines / llguidance |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, spec in FREE_FORM.items():
        seconds = []
        for backend in (outlines, guidance):
            start = time.perf_counter()
            backend.prepare(backend.compile(spec))
            seconds.append(time.perf_counter() - start)
        print(f"| {name} | {len(spec_regex(spec)):,} | {seconds[0]:.2f} | {seconds[1]:.2f} | "
              f"{seconds[0] / seconds[1]:.0f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, help="a local tokenizer directory (default: the two built here)")
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs per backend; medians reported")
    parser.add_argument("--path-tokens", type=int, default=200, help="most tokens per path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--free-form", action="store_true",
                        help="only compile the free-form JSON specs, once per backend (minutes)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("free-form JSON specs, one compile by each backend" if args.free_form
          else f"repeats {args.repeats} (alternating, medians), seed {args.seed}")
    if args.tokenizer is not None:
        run(args.tokenizer, args)
        return
    with tempfile.TemporaryDirectory(prefix="sprig-bench-tok-") as tmp:
        small = Path(tmp) / "bpe-512"
        build_tokenizer(small)
        run(small, args)
        run(stdlib_tokenizer(Path(tmp) / "bpe-32k"), args)


if __name__ == "__main__":
    main()
