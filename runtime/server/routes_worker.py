"""What a load balancer in front of several servers reads from each of them: its load.

SGLang's Model Gateway (`smg`) polls `GET /v1/loads` for its load-aware policies and
balance checks; older routers poll `GET /get_load` and read its `load`. Both are cheap
reads of the HTTP process's own state: the sequences it has in flight (always current)
and the scheduler's last periodic report (at most `stats_interval` old while busy).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from sprig.runtime.server.http_io import ServerState, json_response, state_of

router = APIRouter()


def scheduler_load(st: ServerState) -> dict[str, Any]:
    """One scheduler's load in the gateway's per-rank schema (`SchedulerLoadSnapshot`):
    zero counts before the scheduler's first report."""
    stats = st.manager.stats
    kv_size = stats.kv_size if stats else st.model_info["kv_size"]
    used = stats.kv_used if stats else 0
    running, queued = (stats.running, stats.queued) if stats else (0, 0)
    return {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": queued,
        "num_total_reqs": running + queued,
        "num_used_tokens": used,
        "max_total_num_tokens": kv_size,
        "token_usage": used / kv_size if kv_size else 0.0,
        "gen_throughput": stats.gen_throughput if stats else 0.0,
        "cache_hit_rate": stats.cache_hit_rate if stats else 0.0,
        "max_running_requests": st.engine.scheduler.max_running_requests,
    }


@router.get("/v1/loads")
async def loads(request: Request) -> Response:
    """Every section sprig has (core scheduler counts and KV memory), whatever `include`
    asks for: this server is one data-parallel rank."""
    now = datetime.now(timezone.utc).isoformat()
    return json_response({"timestamp": now, "dp_rank_count": 1, "loads": [scheduler_load(state_of(request))]})


@router.get("/get_load")
async def get_load(request: Request) -> Response:
    """`load`: sequences in flight here (sent to the scheduler and not yet finished)."""
    st = state_of(request)
    snapshot = scheduler_load(st)
    return json_response(
        {
            "load": len(st.manager.tracks),
            "num_running_reqs": snapshot["num_running_reqs"],
            "num_waiting_reqs": snapshot["num_waiting_reqs"],
            "num_used_tokens": snapshot["num_used_tokens"],
        }
    )
