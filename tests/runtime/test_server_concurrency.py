"""Many clients at once: 100 concurrent streaming /generate requests against the session
server all end with [DONE] and the text a non-streamed request gives; afterwards the
scheduler is idle, its KV accounting intact and every slot free or evictable."""

from __future__ import annotations

import asyncio
import time

import httpx
from server_helpers import Server, parse_event

CLIENTS = 100
PARAMS = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
DEADLINE_S = 90.0


def prompts() -> list[str]:
    # 10 shared prefixes x 10 suffixes: the radix cache sees hits and misses mixed
    return [f"request number {i % 10} from the crowd, variant {i // 10}" for i in range(CLIENTS)]


async def stream_one(client: httpx.AsyncClient, url: str, prompt: str) -> list:
    body = {"text": prompt, "sampling_params": PARAMS, "stream": True}
    async with client.stream("POST", url + "/generate", json=body) as r:
        assert r.status_code == 200, await r.aread()
        return [parse_event(line) async for line in r.aiter_lines() if line]


async def stream_all(url: str, headers: dict[str, str], texts: list[str]) -> list[list]:
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8)
    timeout = httpx.Timeout(60.0, connect=10.0, pool=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        tasks = [stream_one(client, url, t) for t in texts]
        return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)


def test_hundred_concurrent_streams_match_non_streamed_output(server: Server) -> None:
    texts = prompts()
    reference = httpx.post(server.url + "/generate", json={"text": texts, "sampling_params": PARAMS},
                           headers=server.headers, timeout=60.0)
    assert reference.status_code == 200, reference.text
    expected = reference.json()
    server.wait_idle()

    start = time.monotonic()
    results = asyncio.run(stream_all(server.url, server.headers, texts))
    elapsed = time.monotonic() - start

    assert len(results) == CLIENTS
    for events, ref in zip(results, expected, strict=True):
        assert events[-1] == "[DONE]", events[-3:]
        chunks = events[:-1]
        assert chunks, "no chunk before [DONE]"
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        final = chunks[-1]
        assert final["meta_info"]["finish_reason"] == {"type": "length", "length": PARAMS["max_new_tokens"]}
        assert final["output_ids"] == ref["output_ids"]
        assert final["text"] == ref["text"]
    assert len({c[-2]["meta_info"]["id"] for c in results}) == CLIENTS
    assert elapsed < DEADLINE_S
    print(f"{CLIENTS} concurrent streams in {elapsed:.1f} s")
    server.wait_idle()
