"""The real server's `POST /v1/score` (SGLang's scoring API): the scores equal the offline
`Engine.score`'s, in SGLang's response shape with the prompts' token counts; bad bodies are
a 400 naming the field, refused before any tokenizing when too large; the scheduler is
idle and intact after each test."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_helpers import Server

from sprig.runtime import Engine

QUERY = "what is the capital of France ?"
ITEMS = [" the", " one two", ""]
LABELS = [9, 300, 41]


@pytest.fixture(autouse=True)
def intact_after(server: Server):
    yield
    server.wait_idle()


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> dict[str, list[list[float]]]:
    with Engine(tiny_llama, dtype="float32") as engine:
        return {"text": engine.score(QUERY, ITEMS, LABELS, apply_softmax=True),
                "probs": engine.score(QUERY, ITEMS, LABELS),
                "ids": engine.score([5, 17, 230], [[40], [77, 3]], LABELS, item_first=True),
                "prompt_tokens": [len(engine.tokenizer.encode(QUERY + i)) for i in ITEMS]}


def score(server: Server, body: dict) -> dict:
    r = server.post("/v1/score", body)
    assert r.status_code == 200, r.text
    return r.json()


def close(got: list[list[float]], want: list[list[float]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-5)


def test_scores_equal_the_offline_engine(server: Server, offline: dict) -> None:
    body = {"model": "any", "query": QUERY, "items": ITEMS, "label_token_ids": LABELS, "apply_softmax": True}
    out = score(server, body)
    assert set(out) == {"scores", "model", "usage", "object"} and out["object"] == "scoring"
    assert out["model"] == server.get("/v1/models").json()["data"][0]["id"]
    close(out["scores"], offline["text"])
    prompt = sum(offline["prompt_tokens"])
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] == prompt
    assert out["usage"]["completion_tokens"] == 0
    again = score(server, body)  # every prompt is now cached but for its last token
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - len(ITEMS)
    close(again["scores"], offline["text"])
    close(score(server, body | {"apply_softmax": False})["scores"], offline["probs"])


def test_token_ids_and_a_single_item(server: Server, offline: dict) -> None:
    out = score(server, {"query": [5, 17, 230], "items": [[40], [77, 3]], "label_token_ids": LABELS,
                         "item_first": True})
    close(out["scores"], offline["ids"])
    one = score(server, {"query": QUERY, "items": ITEMS[1], "label_token_ids": LABELS, "apply_softmax": True})
    close(one["scores"], offline["text"][1:2])


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"query": "a", "items": ["b"]}, "label_token_ids", "non-empty list"),
        ({"query": "a", "items": ["b"], "label_token_ids": []}, "label_token_ids", "non-empty list"),
        ({"query": "a", "items": ["b"], "label_token_ids": [1, 99999]}, "label_token_ids", "outside [0, 512)"),
        ({"query": "a", "items": ["b"], "label_token_ids": list(range(300))}, "label_token_ids", "at most 256"),
        ({"query": "a", "items": ["b"], "label_token_ids": ["x"]}, "label_token_ids", "label_token_ids.0"),
        ({"items": ["b"], "label_token_ids": [1]}, "query", "required"),
        ({"query": "a", "label_token_ids": [1]}, "items", "required"),
        ({"query": "a", "items": [], "label_token_ids": [1]}, "items", "non-empty"),
        ({"query": "a", "items": [[1]], "label_token_ids": [1]}, "items", "both be text"),
        ({"query": [1], "items": ["a"], "label_token_ids": [1]}, "items", "both be text"),
        ({"query": [1, 99999], "items": [[1]], "label_token_ids": [1]}, "query", "outside [0, 512)"),
        ({"query": "", "items": [""], "label_token_ids": [1]}, "items", "items[0] is empty"),
        ({"query": "the cat " * 800, "items": [""], "label_token_ids": [1]}, "items", "context length"),
        ({"query": 5, "items": ["a"], "label_token_ids": [1]}, "query", "query"),
        ({"query": "a", "items": ["b"], "label_token_ids": [1], "apply_softmax": "yes"}, "apply_softmax", "bool"),
        ({"query": "a", "items": ["b"] * 4097, "label_token_ids": [1]}, "items", "at most 4096 sequences"),
        ({"query": "x" * 40_000, "items": ["b"] * 1000, "label_token_ids": [1]}, "items", "bytes of text"),
    ],
)
def test_bad_bodies_are_a_400_naming_the_field(server: Server, body: dict, param: str, needle: str) -> None:
    r = server.post("/v1/score", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_the_openapi_document_describes_the_body(server: Server) -> None:
    doc = server.get("/openapi.json").json()
    body = doc["paths"]["/v1/score"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ScoringRequest"}
    props = doc["components"]["schemas"]["ScoringRequest"]["properties"]
    assert {"query", "items", "label_token_ids", "apply_softmax", "item_first", "model"} <= set(props)
