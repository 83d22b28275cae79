"""The real server with speculation on: the same tokens as without, and the counters in
meta_info and /metrics."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from draft_checkpoints import truncated_draft
from server_helpers import running_server

from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

PROMPT = "the cat the cat the cat the cat"
BODY = {"text": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_speculative_server_reports_acceptance(tiny_llama: Path, server) -> None:
    plain = server.generate(BODY)
    assert "spec_verify_ct" not in plain["meta_info"]
    # pass costs given, not timed: on a busy CPU the timed ones can rule drafting out
    with running_server(tiny_llama, "--speculative-algorithm", "radix", "--speculative-num-draft-tokens", "6",
                        "--speculative-pass-costs", "1,0,0,0,0,0,0") as spec:
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


def test_a_draft_model_server_gives_the_same_tokens(tiny_llama: Path, server, tmp_path) -> None:
    plain = server.generate(BODY)
    draft = truncated_draft(tiny_llama)
    with running_server(tiny_llama, "--speculative-algorithm", "draft", "--speculative-draft-model-path", str(draft),
                        "--speculative-pass-costs", "1,0,0,0,0,0,0") as spec:
        got = spec.generate(BODY)
        assert got["output_ids"] == plain["output_ids"]
        assert got["meta_info"]["spec_verify_ct"] < got["meta_info"]["completion_tokens"]  # drafts were accepted
        assert spec.get("/debug/check_integrity").status_code == 200
    other = build_tiny_checkpoint(tmp_path / "other", "llama", vocab_size=400)
    proc = subprocess.run(
        [sys.executable, "-m", "sprig.runtime", "serve", "--model", str(tiny_llama), "--port", "0",
         "--speculative-algorithm", "draft", "--speculative-draft-model-path", str(other)],
        capture_output=True, text=True, timeout=120, env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 1 and "--speculative-draft-model-path" in proc.stderr + proc.stdout
