"""The real server with speculation on: the same tokens as without, as `/generate` and the
official `openai` client see them, and the counters in meta_info and /metrics."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import Server, running_server

import sprig as sgl
from sprig.runtime.demo import DEMO_MODEL_PATH
from sprig.runtime.demo.tasks import take
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

PROMPT = "the cat the cat the cat the cat"
BODY = {"text": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_speculative_server_reports_acceptance(tiny_llama: Path, server) -> None:
    plain = server.generate(BODY)
    assert not any(key.startswith("spec_") for key in plain["meta_info"])
    plain_completion = {"prompt": PROMPT, "max_tokens": 4}
    assert "completion_tokens_details" not in server.post("/v1/completions", plain_completion).json()["usage"]
    # pass costs given, not timed: on a busy CPU the timed ones can rule drafting out
    with running_server(tiny_llama, "--speculative-algorithm", "radix", "--speculative-num-draft-tokens", "6",
                        "--speculative-pass-costs", "1,0,0,0,0,0,0") as spec:
        first = spec.generate(BODY)
        second = spec.generate(BODY)  # drafted from the first request's cached output
        assert first["output_ids"] == second["output_ids"] == plain["output_ids"]
        meta = second["meta_info"]
        assert meta["spec_verify_ct"] < first["meta_info"]["spec_verify_ct"]
        assert meta["spec_accept_length"] == meta["completion_tokens"] / meta["spec_verify_ct"]
        hist, kept = meta["spec_correct_drafts_histogram"], meta["spec_num_correct_drafts"]
        assert sum(hist) == meta["spec_verify_ct"] and sum(k * n for k, n in enumerate(hist)) == kept > 0
        assert meta["completion_tokens"] == 1 + meta["spec_verify_ct"] + kept
        assert meta["spec_accept_rate"] == kept / meta["spec_num_proposed_drafts"]
        completion = {"prompt": [PROMPT, PROMPT], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        usage = spec.post("/v1/completions", completion).json()["usage"]
        details = usage["completion_tokens_details"]  # drafts kept and rejected, as SGLang reports them
        assert 0 < details["accepted_prediction_tokens"] <= usage["completion_tokens"] - 2
        assert details["rejected_prediction_tokens"] >= 0
        events = spec.stream("/v1/completions", completion | {"stream": True, "stream_options": {"include_usage": True}})
        streamed = events[-2]["usage"]  # the stream's usage chunk
        assert streamed["completion_tokens"] == usage["completion_tokens"]
        assert streamed["completion_tokens_details"]["accepted_prediction_tokens"] > 0
        _frontend_costs_count_drafts(spec)
        spec.wait_idle()
        metrics = spec.get("/metrics").text
        assert _metric(metrics, "sprig_spec_accept_length") > 1.0
        assert 0.0 < _metric(metrics, "sprig_spec_accept_rate") <= 1.0
        [state] = spec.info()["internal_states"]  # where SGLang's benchmark scripts read the accept length
        assert state["avg_spec_accept_length"] == _metric(metrics, "sprig_spec_accept_length")
        assert state["last_gen_throughput"] >= 0.0
    [state] = server.info()["internal_states"]
    assert "avg_spec_accept_length" not in state and state["last_gen_throughput"] >= 0.0


@sgl.function
def _three_calls(s):
    for i in range(3):
        s += PROMPT + sgl.gen(f"out{i}", max_tokens=24, temperature=0, ignore_eos=True)


def _frontend_costs_count_drafts(spec: Server) -> None:
    """`state.cost()` of a program adds up the counts each of its calls reports (native
    API), and the drafts a completion's usage reports (OpenAI API)."""
    state = _three_calls.run(backend=sgl.RuntimeEndpoint(spec.url))
    metas = [state.get_meta_info(f"out{i}") for i in range(3)]
    cost = state.cost()
    assert cost.verify_passes == sum(m["spec_verify_ct"] for m in metas) < cost.completion_tokens - 3
    assert cost.drafts_accepted == sum(m["spec_num_correct_drafts"] for m in metas) > 0
    assert cost.drafts_proposed == sum(m["spec_num_proposed_drafts"] for m in metas)
    assert cost.draft_accept_rate == cost.drafts_accepted / cost.drafts_proposed
    state = _three_calls.run(backend=sgl.OpenAI("tiny", base_url=spec.url + "/v1", api_key="unused"))
    assert state.cost().drafts_accepted > 0 and state.cost().verify_passes == 0  # passes are not in usage


def test_a_draft_the_target_cannot_serve_stops_the_server(tiny_llama: Path, tmp_path) -> None:
    other = build_tiny_checkpoint(tmp_path / "other", "llama", vocab_size=400)
    proc = subprocess.run(
        [sys.executable, "-m", "sprig.runtime", "serve", "--model", str(tiny_llama), "--port", "0",
         "--speculative-algorithm", "draft", "--speculative-draft-model-path", str(other)],
        capture_output=True, text=True, timeout=120, env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 1 and "--speculative-draft-model-path" in proc.stderr + proc.stdout


def _client_answers(server: Server, questions: list[str]) -> list[dict]:
    """What the official client gets for each question: chat with n = 2, seeded samples cut
    by stop strings, logprobs (whole and streamed), and a completion echoing its prompt."""
    openai = pytest.importorskip("openai")
    answers = []
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60.0, max_retries=0) as client:
        for question in questions:
            chat = {"model": "sprig-demo", "messages": [{"role": "user", "content": question}], "max_tokens": 64,
                    "temperature": 0.7, "seed": 5, "n": 2, "stop": ["Answer", " = 1"], "logprobs": True,
                    "top_logprobs": 2}
            whole = client.chat.completions.create(**chat)
            streamed: dict[int, list] = {}
            for chunk in client.chat.completions.create(**chat, stream=True):
                for c in chunk.choices:
                    streamed.setdefault(c.index, []).append(c)
            completion = client.completions.create(model="sprig-demo", prompt=question + "\n", max_tokens=48,
                                                   temperature=0, stop=["."], logprobs=2, echo=True)
            answers.append({
                "chat": [(c.message.content, c.finish_reason, [(t.token, t.logprob) for t in c.logprobs.content])
                         for c in whole.choices],
                "streamed": {i: ("".join(c.delta.content or "" for c in cs), [c.finish_reason for c in cs if c.finish_reason],
                                 [(t.token, t.logprob) for c in cs if c.logprobs for t in c.logprobs.content or []])
                             for i, cs in sorted(streamed.items())},
                "completion": (completion.choices[0].text, completion.choices[0].finish_reason,
                               completion.choices[0].logprobs.tokens, completion.choices[0].logprobs.token_logprobs),
            })
    server.wait_idle()
    return answers


def _same(got, want, path: str = "") -> None:
    """Equal, but for floats (logprobs) within rounding: a verification pass sums in
    another order than the decode pass it stands for."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-4), path
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{path}[{i}]")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for k in want:
            _same(got[k], want[k], f"{path}.{k}")
    else:
        assert got == want, path


def test_the_openai_client_gets_the_same_answers_with_a_draft_model(demo_server: Server) -> None:
    """The demo model and its draft, drafting whenever it can (several tokens a step, so a
    stop string can end a step's run of kept tokens part way): every text, finish reason,
    token and logprob the client sees equals the plain server's, `/generate` gives the same
    tokens with drafts kept, and the pools pass the integrity check."""
    questions = [p.question for p in take("heldout", 2, seed=3)]
    body = {"text": questions[0], "sampling_params": BODY["sampling_params"]}
    plain = demo_server.generate(body)
    want = _client_answers(demo_server, questions)
    with running_server(DEMO_MODEL_PATH, "--speculative-algorithm", "draft", "--speculative-draft-model-path",
                        str(DEMO_MODEL_PATH.parent / "draft"), "--speculative-pass-costs", "1,0,0,0,0,0,0") as spec:
        native = spec.generate(body)
        got = _client_answers(spec, questions)
        accept_length = _metric(spec.get("/metrics").text, "sprig_spec_accept_length")
        assert spec.get("/debug/check_integrity").status_code == 200
    assert native["output_ids"] == plain["output_ids"]
    assert native["meta_info"]["spec_verify_ct"] < native["meta_info"]["completion_tokens"]  # drafts were accepted
    _same(got, want)
    assert all(c[1] == "stop" and c[0] for a in want for c in a["chat"])  # each cut by a stop string
    assert accept_length > 1.5  # most steps kept drafts
