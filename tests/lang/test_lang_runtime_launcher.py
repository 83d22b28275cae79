"""`Runtime`: the command it builds, a healthy start, the failure paths, and SGLang's
`Runtime` calls on a real server."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

import sprig as sgl
from sprig.backend.http import ServerError
from sprig.backend.runtime import server_command

PROMPT = "the quick brown fox"

FAKE_SERVER = str(Path(__file__).with_name("fake_sprig_server.py"))


def test_server_command_maps_keyword_arguments_to_flags() -> None:
    argv = server_command("/m/tiny", "127.0.0.1", 31234, mem_fraction=0.5, disable_radix_cache=True,
                          enable_x=False, chunked_prefill_size=None, stop_ids=[1, 2])
    assert argv == [sys.executable, "-m", "sprig.runtime", "serve", "--model", "/m/tiny",
                    "--host", "127.0.0.1", "--port", "31234", "--mem-fraction", "0.5",
                    "--disable-radix-cache", "--stop-ids", "1", "2"]


def test_a_runtime_waits_for_health_and_serves_programs() -> None:
    with sgl.Runtime("/m/tiny", launcher=(sys.executable, FAKE_SERVER), launch_timeout=30) as runtime:
        assert runtime.url.startswith("http://127.0.0.1:")
        assert runtime.command[2:6] == ["serve", "--model", "/m/tiny", "--host"]
        assert runtime.endpoint.get_model_name() == "/m/tiny"

        @sgl.function
        def program(s):
            s += "abc" + sgl.gen("n")

        sgl.set_default_backend(runtime)
        assert program.run()["n"] == "[3]"
        process = runtime._process
    assert process is not None and process.poll() is not None  # shut down by the with block


def test_a_server_that_dies_is_reported_with_its_output() -> None:
    crash = "import sys; print('loading weights'); sys.stderr.write('CUDA out of memory\\n'); sys.exit(3)"
    with pytest.raises(RuntimeError, match="exited with code 3") as info:
        sgl.Runtime("/m/tiny", launcher=(sys.executable, "-c", crash), launch_timeout=30)
    assert "CUDA out of memory" in str(info.value) and "loading weights" in str(info.value)


def test_a_server_that_never_gets_healthy_times_out_and_is_stopped() -> None:
    hang = "import time; print('still loading', flush=True); time.sleep(60)"
    with pytest.raises(TimeoutError, match="not healthy within 1s") as info:
        sgl.Runtime("/m/tiny", launcher=(sys.executable, "-c", hang), launch_timeout=1)
    assert "still loading" in str(info.value)


def test_the_default_model_is_the_embedded_demo_model() -> None:
    from sprig.runtime.demo import DEMO_MODEL_PATH

    show_argv_and_fail = "import sys; print(sys.argv, flush=True); sys.exit(3)"
    with pytest.raises(RuntimeError) as info:
        sgl.Runtime(launcher=(sys.executable, "-c", show_argv_and_fail), launch_timeout=5)
    assert f"'--model', '{DEMO_MODEL_PATH}'" in str(info.value)


def test_sglangs_runtime_calls_on_a_real_server(tiny_llama: Path) -> None:
    """SGLang's `Runtime.generate` / `encode` (JSON text back), `async_generate` and its
    name `add_request` (pieces of text), `get_server_info` (awaited) and `get_tokenizer`."""
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with sgl.Runtime(str(tiny_llama), dtype="float32") as runtime:
        out = json.loads(runtime.generate(PROMPT, params))
        direct = httpx.post(runtime.url + "/generate", json={"text": PROMPT, "sampling_params": params}, timeout=60)
        assert out["output_ids"] == direct.json()["output_ids"] and out["meta_info"]["completion_tokens"] == 12
        batch = json.loads(runtime.generate([PROMPT, "one two"], params, return_logprob=True, top_logprobs_num=2))
        assert [len(b["meta_info"]["output_top_logprobs"]) for b in batch] == [12, 12]
        assert batch[0]["text"] == out["text"]

        async def streamed() -> tuple[list[str], list[str]]:
            return ([p async for p in runtime.async_generate(PROMPT, params)],
                    [p async for p in runtime.add_request(PROMPT, params)])

        pieces, again = asyncio.run(streamed())
        assert len(pieces) > 1 and "".join(pieces) == "".join(again) == out["text"]
        embedded = json.loads(runtime.encode([PROMPT, "one two"]))
        assert [len(e["embedding"]) for e in embedded] == [64, 64]
        assert math.fsum(v * v for v in embedded[0]["embedding"]) == pytest.approx(1.0, abs=1e-5)
        assert asyncio.run(runtime.get_server_info())["model_path"] == str(tiny_llama)
        assert runtime.get_tokenizer().encode(PROMPT) == AutoTokenizer.from_pretrained(tiny_llama).encode(PROMPT)
        with pytest.raises(ServerError, match="max_new_tokens"):
            runtime.generate(PROMPT, {"max_new_tokens": -1})

        async def refused() -> list[str]:
            return [p async for p in runtime.async_generate(PROMPT, {"max_new_tokens": -1})]

        with pytest.raises(ServerError, match="max_new_tokens"):
            asyncio.run(refused())
        assert httpx.get(runtime.url + "/debug/check_integrity", timeout=30).json()["ok"]
