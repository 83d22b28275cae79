"""The responses a server keeps (`store`, the default), for `previous_response_id` and
`GET /v1/responses/{id}` (and its input items): in memory, within `max_bytes` of JSON, the least recently used
dropped first, each readable and deletable only by the client (API key) that made it.
Nothing survives a restart; a response the store no longer holds is a 404."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True)
class Stored:
    """A response object and the input items it was generated after (its predecessors'
    included, in their listed form: `responses_items.as_listed`)."""

    client: int | None
    response: dict[str, Any]
    inputs: list[dict[str, Any]]
    size: int

    @property
    def items(self) -> list[dict[str, Any]]:
        """The conversation so far: the input items, then the response's output items."""
        return self.inputs + self.response["output"]


class ResponseStore:
    """Thread-safe (read on the request pool, written on the event loop)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, client: int | None, response: dict[str, Any], inputs: list[dict[str, Any]]) -> bool:
        """Keep `response` after `inputs`; False when it alone exceeds `max_bytes` (then
        it is not kept)."""
        size = len(orjson.dumps(response)) + len(orjson.dumps(inputs))
        if size > self.max_bytes:
            return False
        with self._lock:
            self._drop(response["id"])
            while self._entries and self._bytes + size > self.max_bytes:
                self._drop(next(iter(self._entries)))
            self._entries[response["id"]] = Stored(client, response, inputs, size)
            self._bytes += size
        return True

    def get(self, client: int | None, rid: str) -> Stored | None:
        """The response `rid` if `client` made it and it is still kept (now the most
        recently used)."""
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None or entry.client != client:
                return None
            self._entries.move_to_end(rid)
            return entry

    def delete(self, client: int | None, rid: str) -> bool:
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None or entry.client != client:
                return False
            self._drop(rid)
            return True

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, rid: str) -> None:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self._bytes -= entry.size
