"""A pool too small for two requests at once: the server retracts one to free KV slots,
and says so. `meta_info.num_retractions` counts each request's retractions (SGLang's
name), `/metrics` counts them all and per finished request, and the outputs equal the
requests run alone."""

from __future__ import annotations

import re
import time
from pathlib import Path

from server_helpers import Server, running_server

PROMPTS = [[5 + i % 50 for i in range(40)], [7 + i % 40 for i in range(50)]]
PARAMS = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
TIGHT = ("--max-total-tokens", "72", "--chunked-prefill-size", "8",
         "--new-token-ratio", "0", "--min-new-token-ratio", "0")


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def _metrics_once_counted(server: Server, retractions: int) -> str:
    """/metrics once the scheduler's idle report (sent as it becomes idle) has arrived."""
    deadline = time.monotonic() + 10
    while _sample(text := server.get("/metrics").text, "sprig_retractions_total") != retractions:
        assert time.monotonic() < deadline, text
        time.sleep(0.1)
    return text


def test_a_retracted_request_reports_its_retractions(tiny_llama: Path) -> None:
    with running_server(tiny_llama, *TIGHT) as server:
        both = server.generate({"input_ids": PROMPTS, "sampling_params": PARAMS})
        counts = [o["meta_info"]["num_retractions"] for o in both]
        assert sum(counts) > 0
        server.wait_idle()
        metrics = _metrics_once_counted(server, sum(counts))
        assert _sample(metrics, "sprig_num_retractions_count") == 2
        assert _sample(metrics, "sprig_num_retractions_sum") == sum(counts)
        assert _sample(metrics, 'sprig_num_retractions_bucket{le="0.0"}') == counts.count(0)
        server.post("/flush_cache")
        alone = [server.generate({"input_ids": p, "sampling_params": PARAMS}) for p in PROMPTS]
        assert [o["output_ids"] for o in both] == [o["output_ids"] for o in alone]
        assert [o["meta_info"]["num_retractions"] for o in alone] == [0, 0]
        server.wait_idle()
