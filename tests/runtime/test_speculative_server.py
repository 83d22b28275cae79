"""The real server with speculation on: the same tokens as without, and the counters in
meta_info and /metrics."""

from __future__ import annotations

import re
from pathlib import Path

from server_helpers import running_server

PROMPT = "the cat the cat the cat the cat"
BODY = {"text": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_speculative_server_reports_acceptance(tiny_llama: Path, server) -> None:
    plain = server.generate(BODY)
    assert "spec_verify_ct" not in plain["meta_info"]
    with running_server(tiny_llama, "--speculative-algorithm", "radix", "--speculative-num-draft-tokens", "6") as spec:
        first = spec.generate(BODY)
        second = spec.generate(BODY)  # drafted from the first request's cached output
        assert first["output_ids"] == second["output_ids"] == plain["output_ids"]
        meta = second["meta_info"]
        assert meta["spec_verify_ct"] < first["meta_info"]["spec_verify_ct"]
        assert meta["spec_accept_length"] == meta["completion_tokens"] / meta["spec_verify_ct"]
        spec.wait_idle()
        metrics = spec.get("/metrics").text
        assert _metric(metrics, "sprig_spec_accept_length") > 1.0
        assert 0.0 < _metric(metrics, "sprig_spec_accept_rate") <= 1.0
