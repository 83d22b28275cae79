"""Run SGLang's own test programs (`sglang/test/test_programs.py`) against a server.

    python sglang_programs.py URL                      # SGLang's frontend (in .venv-sglang)
    python sglang_programs.py URL --as-sprig SITE      # the same programs under `import sprig as sgl`

Prints one JSON line per program: {"program", "outcome", "error", "attempts"}. Outcomes: "pass";
"answer" when a program that checks its model's answer ran to that check and the (tiny,
random) model's answer failed it; "fail" for anything else.

With `--as-sprig`, SITE is the site-packages directory of an environment where sglang is
installed: its `test_programs.py` is loaded from there as a plain file, with `sglang`
standing for `sprig` (the file's `import sglang as sgl` then gets sprig), so the programs
are SGLang's, unchanged and not copied here. Two names the file takes from SGLang's
internals are provided: `sglang.srt.utils.is_hip` (False) and `sglang.lang.ir`'s regexes
(sprig's, the same constants).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import traceback
import types
from pathlib import Path
from typing import Any

# (program, keyword arguments, the exceptions by which it rejects a model's answer: a
# wrong fact, or a JSON string left open when max_new_tokens ran out). Not run:
# test_image_qa (images); test_completion_speculative and test_chat_completion_speculative
# (speculative execution over OpenAI's API); test_tool_use (it evals the generated text as
# Python); test_parallel_encoding (its join(mode="concate_and_append") calls
# /concate_and_append_request, which SGLang's own server no longer serves: the frontend
# then waits forever); test_gen_min_new_tokens (it reads
# global_config.default_backend.endpoint, which a RuntimeEndpoint lacks in SGLang's own
# frontend, and loads the tokenizer through SGLang's server utilities).
# SGLang's `text_async_iter(var, return_meta_data=True)` pairs a piece of text with the
# meta_info current when its thread wakes: when two events arrive before it wakes, it
# yields their text together with the second's logprobs only, and test_stream_logprobs
# fails (a race in that frontend, whatever the server). It is tried up to this many times.
ATTEMPTS = {"test_stream_logprobs": 10}
ANSWER = (AssertionError,)
JSON_ANSWER = (AssertionError, json.JSONDecodeError)
PROGRAMS: list[tuple[str, dict[str, Any], tuple[type[Exception], ...]]] = [
    ("test_few_shot_qa", {}, ANSWER),
    ("test_mt_bench", {}, ()),
    ("test_select", {"check_answer": False}, ()),
    ("test_decode_int", {}, ANSWER),
    ("test_decode_json_regex", {}, JSON_ANSWER),
    ("test_decode_json", {}, JSON_ANSWER),
    ("test_expert_answer", {"check_answer": False}, ()),
    ("test_react", {}, ANSWER),
    ("test_parallel_decoding", {}, ()),
    ("test_stream", {}, ()),
    ("test_stream_logprobs", {}, ()),
    ("test_regex", {}, ()),
    ("test_dtype_gen", {}, ()),
]


def _as_sprig(site: Path) -> types.ModuleType:
    import sprig

    srt_utils = types.ModuleType("sglang.srt.utils")
    srt_utils.is_hip = lambda: False
    sys.modules.update({
        "sglang": sprig,
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.utils": srt_utils,
        "sglang.lang": types.ModuleType("sglang.lang"),
        "sglang.lang.ir": sprig.sampling,
    })
    spec = importlib.util.spec_from_file_location("sglang_test_programs", site / "sglang" / "test" / "test_programs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sprig.set_default_backend(sprig.RuntimeEndpoint(URL))
    return module


def _sglang() -> types.ModuleType:
    import sglang
    from sglang.test import test_programs

    sglang.set_default_backend(sglang.RuntimeEndpoint(URL))
    return test_programs


def _outcome(exc: BaseException, module: types.ModuleType, answer_errors: tuple[type[Exception], ...]) -> str:
    """"answer" if the program itself rejected its model's answer (`answer_errors`,
    raised in a frame of the program's own file); anything else is a failure."""
    files = {frame.filename for frame in traceback.extract_tb(exc.__traceback__)}
    return "answer" if isinstance(exc, answer_errors) and module.__file__ in files else "fail"


def main() -> None:
    global URL
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--as-sprig", type=Path, metavar="SITE_PACKAGES")
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    URL = args.url
    module = _as_sprig(args.as_sprig) if args.as_sprig else _sglang()
    for name, kwargs, answer_errors in PROGRAMS:
        if args.only and name not in args.only:
            continue
        attempts = 0
        while True:
            attempts += 1
            try:
                getattr(module, name)(**kwargs)
                outcome, error = "pass", None
            except Exception as exc:  # every outcome is reported; the caller judges
                outcome, error = _outcome(exc, module, answer_errors), f"{type(exc).__name__}: {exc}"[:300]
            if outcome == "pass" or attempts >= ATTEMPTS.get(name, 1):
                break
        report = {"program": name, "outcome": outcome, "error": error, "attempts": attempts}
        print(json.dumps(report), flush=True)


URL = ""

if __name__ == "__main__":
    main()
