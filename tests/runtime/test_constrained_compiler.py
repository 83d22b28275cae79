"""The compile service: cached by key, one compile per key however many ask, bounded by
bytes, never blocking the caller, and a pathological grammar killed at its timeout."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from transformers import AutoTokenizer

from sprig.runtime.constrained import (
    CompilerConfig,
    GrammarCompiler,
    GrammarSpec,
    GrammarTimeoutError,
    OutlinesBackend,
)
from sprig.runtime.tiny_checkpoint import build_tokenizer

SLOW = GrammarSpec.regex("(a|b)*a(a|b){18}")  # ~2^18 DFA states: seconds to compile


@pytest.fixture(scope="module")
def backend(tmp_path_factory) -> OutlinesBackend:
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return OutlinesBackend.from_tokenizer(AutoTokenizer.from_pretrained(str(path)))


@pytest.fixture(scope="module")
def compiler(backend):
    with GrammarCompiler(backend, CompilerConfig(timeout_s=0.5, num_workers=2)) as c:
        yield c


def test_a_cached_grammar_is_the_same_object(compiler):
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    first = compiler.get(spec)
    started = compiler.compiles_started
    assert compiler.get(spec) is first
    assert compiler.poll(compiler.submit(spec)) is first
    assert compiler.compiles_started == started
    assert compiler.cached_bytes > 0


def test_concurrent_submits_share_one_compile(compiler):
    spec = GrammarSpec.regex("[a-z]{1,12}(, [a-z]{1,12}){0,5}")
    started = compiler.compiles_started
    barrier = threading.Barrier(8)
    futures = []

    def ask() -> None:
        barrier.wait()
        futures.append(compiler.submit(spec))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = {id(f.result(timeout=30)) for f in futures}
    assert len(results) == 1
    assert compiler.compiles_started == started + 1


def test_slow_grammar_times_out_without_holding_back_others(compiler):
    slow = compiler.submit(SLOW)
    assert compiler.poll(slow) is None  # submit returned at once; still compiling
    start = time.monotonic()
    assert compiler.get(GrammarSpec.regex("(yes|no)"), timeout=30).regex == "(yes|no)"
    with pytest.raises(GrammarTimeoutError, match=r"longer than 0\.5 s"):
        slow.result(timeout=30)
    assert time.monotonic() - start < 10
    started = compiler.compiles_started
    with pytest.raises(GrammarTimeoutError):  # remembered: fails at once, no new compile
        compiler.poll(compiler.submit(SLOW))
    assert compiler.compiles_started == started
    assert compiler.get(GrammarSpec.regex("[0-9]+"), timeout=30) is not None  # a fresh worker


def test_slow_grammars_cannot_starve_the_pool(backend):
    """Two slow patterns on a pool of two: each is moved to the slow lane after its first
    0.3 s, so an ordinary grammar compiles while both are still pending (it used to wait
    for one to time out)."""
    config = CompilerConfig(timeout_s=4, slow_after_s=0.3, num_workers=2)
    with GrammarCompiler(backend, config) as c:
        slow = [c.submit(GrammarSpec.regex(f"(a|b)*a(a|b){{{n}}}")) for n in (18, 19)]
        assert c.get(GrammarSpec.regex("(yes|no)"), timeout=30).regex == "(yes|no)"
        assert not any(f.done() for f in slow)
        for f in slow:
            with pytest.raises(GrammarTimeoutError, match="longer than 4 s"):
                f.result(timeout=60)
        assert c.submit(GrammarSpec.regex("(a|b)*a(a|b){18}")).done()  # remembered: fails at once


def test_invalid_spec_fails_its_future_with_a_value_error(compiler):
    future = compiler.submit(GrammarSpec.regex("(unclosed"))
    with pytest.raises(ValueError, match="missing \\)"):
        future.result(timeout=30)
    with pytest.raises(ValueError, match="must be a JSON object"):
        compiler.get(GrammarSpec.json_schema("[]"), timeout=30)


def test_a_grammar_that_exhausts_memory_fails_alone(backend):
    nested = '{"type": "array", "items": ' * 40 + '{"type": "integer"}' + "}" * 40
    config = CompilerConfig(timeout_s=20, num_workers=1, worker_memory_bytes=1 << 30)
    with GrammarCompiler(backend, config) as small:
        with pytest.raises(ValueError, match="out of memory"):
            small.get(GrammarSpec.json_schema(nested), timeout=30)
        assert small.get(GrammarSpec.regex("ok"), timeout=30).regex == "ok"


def test_lru_is_bounded_by_bytes(backend):
    a, b = GrammarSpec.regex("[a-z]{1,40}"), GrammarSpec.regex("[0-9]{1,40}")
    sizes = []
    with GrammarCompiler(backend, CompilerConfig(num_workers=1)) as probe:
        for spec in (a, b):
            before = probe.cached_bytes
            probe.get(spec)
            sizes.append(probe.cached_bytes - before)
    config = CompilerConfig(num_workers=1, cache_bytes=max(sizes) + min(sizes) // 2)
    with GrammarCompiler(backend, config) as small:
        first = small.get(a)
        small.get(b)  # evicts a
        assert small.cached_bytes <= config.cache_bytes
        assert small.get(a) is not first and small.compiles_started == 3
    with pytest.raises(RuntimeError, match="closed"):
        small.submit(a)


def test_config_is_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        CompilerConfig(timeout_s=0)


def test_the_worker_starts_without_torch():
    probe = "import sys, sprig.runtime.constrained.worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
