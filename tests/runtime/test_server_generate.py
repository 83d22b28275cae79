"""The real server's native routes: /generate (single, batch, input_ids, n, logprobs,
streaming, stop strings and stop_regex, aborts), equal to the offline Engine; the info, cache and health
routes. After every test the scheduler is idle with its KV accounting intact."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import httpx
import pytest
from server_helpers import TIMEOUT, Server, parse_event

from sprig.runtime import Engine

PROMPTS = ["the quick brown fox", "what is the capital of France ?", "one two three"]
GREEDY = {"max_new_tokens": 8, "temperature": 0}


@pytest.fixture(autouse=True)
def intact_after(server: Server):
    yield
    server.wait_idle()


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> list[dict]:
    with Engine(tiny_llama, dtype="float32") as engine:
        return [engine.generate(p, GREEDY) for p in PROMPTS]


def test_greedy_generate_equals_the_offline_engine(server: Server, offline: list[dict]) -> None:
    for prompt, ref in zip(PROMPTS, offline, strict=True):
        out = server.generate({"text": prompt, "sampling_params": GREEDY})
        assert out["output_ids"] == ref["output_ids"]
        assert out["text"] == ref["text"]
        assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
        assert out["meta_info"]["prompt_tokens"] == ref["meta_info"]["prompt_tokens"]


def test_batch_and_input_ids(server: Server, offline: list[dict], tiny_llama: Path) -> None:
    outs = server.generate({"text": PROMPTS, "sampling_params": GREEDY})
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in offline]
    assert len({o["meta_info"]["id"] for o in outs}) == len(PROMPTS)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_llama).encode(PROMPTS[0])
    single = server.generate({"input_ids": ids, "sampling_params": GREEDY})
    assert single["output_ids"] == offline[0]["output_ids"]
    per_prompt = [GREEDY, {**GREEDY, "max_new_tokens": 3}]
    both = server.generate({"input_ids": [ids, ids], "sampling_params": per_prompt})
    assert [len(o["output_ids"]) for o in both] == [8, 3]


def test_n_returns_n_outputs_per_prompt(server: Server) -> None:
    outs = server.generate({"text": PROMPTS[:2], "sampling_params": {**GREEDY, "n": 2}, "rid": ["a", "b"]})
    assert [o["meta_info"]["id"] for o in outs] == ["a-0", "a-1", "b-0", "b-1"]
    assert outs[0]["output_ids"] == outs[1]["output_ids"] != outs[2]["output_ids"] == outs[3]["output_ids"]
    seeded = server.generate({"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "n": 2, "seed": 7}})
    assert len(seeded) == 2 and seeded[0]["output_ids"] != seeded[1]["output_ids"]


def test_logprobs(server: Server) -> None:
    out = server.generate({
        "text": PROMPTS[1], "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0,
        "top_logprobs_num": 2, "return_text_in_logprobs": True,
    })
    meta = out["meta_info"]
    inputs, outputs = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert len(inputs) == meta["prompt_tokens"] and inputs[0][0] is None
    assert all(lp <= 0 for lp, _, _ in inputs[1:] + outputs)
    assert [t for _, t, _ in outputs] == out["output_ids"]
    assert "".join(text for _, _, text in outputs) == out["text"]
    assert all(len(row) == 2 and row[0][0] >= row[1][0] for row in meta["output_top_logprobs"])
    assert outputs[0][0] == pytest.approx(meta["output_top_logprobs"][0][0][0])  # greedy: the top token


def test_logprob_options_per_prompt(server: Server) -> None:
    """SGLang's /generate takes each logprob option as one value or a list with one per
    prompt; each prompt's samples share its entry, and its logprobs equal those it gets
    asked alone."""
    params = GREEDY | {"n": 2}
    both = server.generate({"text": PROMPTS[:2], "sampling_params": params, "return_logprob": [False, True],
                            "logprob_start_len": [-1, 1], "top_logprobs_num": [0, 3],
                            "token_ids_logprob": [[4], [8, 2]]})
    assert len(both) == 4
    assert not any("output_token_logprobs" in out["meta_info"] for out in both[:2])
    alone = server.generate({"text": PROMPTS[1], "sampling_params": GREEDY, "return_logprob": True,
                             "logprob_start_len": 1, "top_logprobs_num": 3, "token_ids_logprob": [8, 2]})["meta_info"]
    for out in both[2:]:
        meta = out["meta_info"]
        assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] - 1
        assert all(len(row) == 3 for row in meta["output_top_logprobs"])
        for key in ("input_token_logprobs", "output_token_logprobs"):
            assert [t for _, t, _ in meta[key]] == [t for _, t, _ in alone[key]]
            assert [lp for lp, _, _ in meta[key]] == pytest.approx([lp for lp, _, _ in alone[key]], abs=1e-5)
        for key in ("input_token_ids_logprobs", "output_token_ids_logprobs"):
            assert [[t for _, t, _ in row] for row in meta[key]] == [[8, 2]] * len(alone[key])
            assert [e[0] for row in meta[key] for e in row] == pytest.approx(
                [e[0] for row in alone[key] for e in row], abs=1e-5)
    server.wait_idle()


def test_stream_sends_cumulative_text_then_done(server: Server) -> None:
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    events = server.stream("/generate", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = [c["text"] for c in chunks]
    assert all(a == b[: len(a)] for a, b in itertools.pairwise(texts))
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    final = server.generate(body)
    assert chunks[-1]["text"] == final["text"] and chunks[-1]["output_ids"] == final["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 24}


def test_second_identical_request_hits_the_cache(server: Server) -> None:
    body = {"text": "the cache tree and the radix prefix " * 4, "sampling_params": {**GREEDY, "max_new_tokens": 2}}
    first, second = server.generate(body), server.generate(body)
    assert second["meta_info"]["cached_tokens"] > 0
    assert second["output_ids"] == first["output_ids"]


def test_stop_string_is_trimmed(server: Server) -> None:
    body = {"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    full = server.generate(body)["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    out = server.generate({**body, "sampling_params": {**body["sampling_params"], "stop": stop}})
    assert out["text"] == full[: full.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_stop_regex_ends_at_the_match(server: Server) -> None:
    body = {"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    full = server.generate(body)["text"]
    piece = full[len(full) // 2 : len(full) // 2 + 2]
    pattern = re.escape(piece[0]) + "[" + re.escape(piece[1]) + "]"

    def with_params(**extra: object) -> dict:
        return {**body, "sampling_params": {**body["sampling_params"], **extra}}

    out = server.generate(with_params(stop_regex=pattern))
    assert out["text"] == full[: full.index(piece)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    kept = server.generate(with_params(stop_regex=[pattern], no_stop_trim=True))
    assert kept["text"] == full[: full.index(piece) + 2] and kept["output_ids"] == out["output_ids"]
    events = server.stream("/generate", {**with_params(stop_regex=pattern), "stream": True})
    assert events[-2]["text"] == out["text"] and events[-2]["output_ids"] == out["output_ids"]
    batch = server.generate({"text": [PROMPTS[0], PROMPTS[2]], "sampling_params": [GREEDY, with_params(
        stop_regex=pattern)["sampling_params"]]})
    assert batch[1]["output_ids"] == out["output_ids"] and batch[0]["text"] != ""
    for none in (None, []):  # what SGLang's frontend sends when a gen has no pattern
        assert server.generate(with_params(stop_regex=none))["text"] == full
    bad = server.post("/generate", with_params(stop_regex="(unclosed"))
    assert bad.status_code == 400 and "stop_regex" in bad.json()["error"]["message"]


def test_streamed_logprobs_hold_each_events_new_tokens(server: Server) -> None:
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2, "token_ids_logprob": [5, 6]}
    final = server.generate(body)["meta_info"]
    events = server.stream("/generate", {**body, "stream": True})[:-1]
    assert len(events) > 2
    seen = 0
    for event in events:
        meta = event["meta_info"]
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"] == len(event["output_ids"])
        assert (len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"])
                == len(meta["output_token_ids_logprobs"]) == meta["completion_tokens"] - seen)
        seen = meta["completion_tokens"]
    texts = [e["text"] for e in events]
    assert texts[0] and all(len(a) < len(b) for a, b in itertools.pairwise(texts[:-1]))  # each brings text
    assert [e for ev in events for e in ev["meta_info"]["output_token_logprobs"]] == final["output_token_logprobs"]
    for key in ("output_top_logprobs", "output_token_ids_logprobs"):
        assert [r for ev in events for r in ev["meta_info"][key]] == final[key]
    assert final["output_token_logprobs_length"] == 12
    assert [[t for _, t, _ in row] for row in final["output_token_ids_logprobs"]] == [[5, 6]] * 12


def test_abort_request_ends_a_running_request(server: Server) -> None:
    body = {"text": PROMPTS[0], "rid": "victim", "stream": True,
            "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=TIMEOUT) as r:
        lines = (line for line in r.iter_lines() if line)
        parse_event(next(lines))
        assert server.post("/abort_request", {"rid": "victim"}).json() == {"rid": "victim", "aborted": True}
        events = [parse_event(line) for line in lines]
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert server.post("/abort_request", {"rid": "victim"}).json()["aborted"] is False


def test_client_disconnect_mid_stream_frees_its_slots(server: Server) -> None:
    server.wait_idle()
    server.post("/flush_cache")  # the session server's cache holds other tests' prefixes
    idle = server.wait_idle()
    body = {"text": PROMPTS[1], "stream": True, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=TIMEOUT) as r:
        lines = (line for line in r.iter_lines() if line)
        parse_event(next(lines))
        parse_event(next(lines))
    after = server.wait_idle()  # running drops to 0 long before 900 tokens
    assert after["kv_available"] + after["kv_evictable"] == idle["kv_size"]
    assert after["kv_evictable"] < 900  # the request did not run to the end
    server.post("/flush_cache")
    with pytest.raises(httpx.TimeoutException):  # a non-streaming client that gives up
        httpx.post(server.url + "/generate", json={**body, "stream": False}, timeout=0.2)
    assert server.wait_idle(timeout=5.0)["kv_evictable"] < 900


def test_info_routes(server: Server, tiny_llama: Path) -> None:
    for path in ("/get_model_info", "/model_info"):
        info = server.get(path).json()
        assert info["model_path"] == str(tiny_llama) and info["is_generation"] is True
        assert "<|assistant|>" in info["chat_template"]
        assert info["has_image_understanding"] is False  # a text model
    for path in ("/get_server_info", "/server_info"):
        info = server.get(path).json()
        assert info["healthy"] and info["model"]["context_len"] == 1024
        assert info["last_idle_integrity"] in ("ok", "unchecked")
    assert server.get("/health").status_code == 200
    assert server.get("/health_generate").status_code == 200


def test_flush_cache_and_metrics(server: Server) -> None:
    server.generate({"text": PROMPTS[0], "sampling_params": GREEDY})
    assert server.post("/flush_cache").json() == {"message": "Cache flushed."}
    assert server.wait_idle()["kv_evictable"] == 0
    metrics = server.get("/metrics").text
    for name in ("sprig_requests_finished_total", "sprig_running_requests", "sprig_queued_requests",
                 "sprig_kv_usage", "sprig_cache_hit_rate", "sprig_gen_throughput",
                 "sprig_time_to_first_token_seconds_bucket", "sprig_inter_token_latency_seconds_bucket"):
        assert name in metrics
    assert "running 0, queued 0" in server.log.read_text() or "tok/s" in server.log.read_text()


def test_the_log_says_what_startup_is_doing(server: Server) -> None:
    """Before the model is ready, the log says the port is bound, the model is loading,
    how long loading and warm-up took, and the dtype, device and pool it loaded with (those
    `/get_server_info` reports: cpu here, cuda on a GPU)."""
    log = server.log.read_text()
    steps = ["sprig.launch: bound 127.0.0.1:", "sprig.scheduler: loading the model from",
             "sprig.scheduler: model loaded in", "sprig.scheduler: scheduler ready (warm-up"]
    at = [log.find(step) for step in steps]
    assert -1 not in at and at == sorted(at), log[:3000]
    model = server.info()["model"]
    assert f"float32 on {model['device']}, a KV pool of {model['kv_size']} tokens" in log
    assert "sprig server ready at" in log
