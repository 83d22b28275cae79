"""The real server's embeddings: SGLang's `/encode` and OpenAI's `/v1/embeddings` equal the
offline `Engine.encode`, as floats and as base64, with `dimensions`, driven by hand, by the
official `openai` client and by LangChain's `OpenAIEmbeddings`; bad bodies are a 400
naming the field; the scheduler is idle and intact after each test."""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from server_helpers import Server

from sprig.runtime import Engine

openai = pytest.importorskip("openai")
langchain_openai = pytest.importorskip("langchain_openai")

TEXTS = ["the quick brown fox", "what is the capital of France ?", "one two three four five six"]


@pytest.fixture(autouse=True)
def intact_after(server: Server) -> Iterator[None]:
    yield
    server.wait_idle()


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> list[list[float]]:
    with Engine(tiny_llama, dtype="float32") as engine:
        return [o["embedding"] for o in engine.encode(TEXTS)]


def close(got: list[float], want: list[float], tol: float = 1e-5) -> None:
    assert len(got) == len(want)
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) <= tol


def embeddings(server: Server, body: dict) -> dict:
    r = server.post("/v1/embeddings", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_encode_equals_the_offline_engine(server: Server, offline: list[list[float]]) -> None:
    one = server.post("/encode", {"text": TEXTS[0]}).json()
    assert set(one) == {"embedding", "meta_info"} and one["meta_info"]["completion_tokens"] == 0
    close(one["embedding"], offline[0])
    batch = server.post("/encode", {"text": TEXTS, "rid": ["e0", "e1", "e2"]}).json()
    assert [o["meta_info"]["id"] for o in batch] == ["e0", "e1", "e2"]
    for out, want in zip(batch, offline, strict=True):
        close(out["embedding"], want)


def test_v1_embeddings_floats_base64_ids_and_dimensions(server: Server, offline: list[list[float]]) -> None:
    out = embeddings(server, {"model": "any", "input": TEXTS})
    assert out["object"] == "list" and out["model"] == server.get("/v1/models").json()["data"][0]["id"]
    assert [d["index"] for d in out["data"]] == [0, 1, 2] and {d["object"] for d in out["data"]} == {"embedding"}
    for d, want in zip(out["data"], offline, strict=True):
        close(d["embedding"], want)
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] > len(TEXTS)
    packed = embeddings(server, {"input": TEXTS[1], "encoding_format": "base64"})["data"][0]["embedding"]
    close(np.frombuffer(base64.b64decode(packed), dtype="<f4").tolist(), offline[1], tol=1e-6)
    ids = server.post("/tokenize", {"prompt": TEXTS[2]}).json()["tokens"]
    close(embeddings(server, {"input": ids})["data"][0]["embedding"], offline[2])
    close(embeddings(server, {"input": [ids, ids]})["data"][1]["embedding"], offline[2])
    short = embeddings(server, {"input": TEXTS[0], "dimensions": 8})["data"][0]["embedding"]
    head = offline[0][:8]
    norm = math.sqrt(sum(v * v for v in head))
    close(short, [v / norm for v in head])


def test_the_openai_client_and_langchain(server: Server, offline: list[list[float]]) -> None:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=30.0, max_retries=0) as client:
        res = client.embeddings.create(model="any", input=TEXTS)  # the client asks for base64
        for d, want in zip(res.data, offline, strict=True):
            close(d.embedding, want)
        assert res.usage.prompt_tokens > len(TEXTS)
    emb = langchain_openai.OpenAIEmbeddings(model="any", base_url=server.url + "/v1", api_key="unused",
                                            check_embedding_ctx_length=False, max_retries=0)
    for got, want in zip(emb.embed_documents(TEXTS), offline, strict=True):
        close(got, want)
    close(emb.embed_query(TEXTS[0]), offline[0])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {}, "input"),
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": [[]]}, "input"),
        ("/v1/embeddings", {"input": [1, 99999]}, "input"),
        ("/v1/embeddings", {"input": "the cat " * 800}, "input"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "binary"}, "encoding_format"),
        ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"input": "a", "dimensions": 100_000}, "dimensions"),
        ("/encode", {}, "text"),
        ("/encode", {"text": "a", "input_ids": [1]}, "text"),
        ("/encode", {"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
    ],
)
def test_bad_bodies_are_a_400_naming_the_field(server: Server, path: str, body: dict, param: str) -> None:
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_the_openapi_document_describes_the_bodies(server: Server) -> None:
    doc = server.get("/openapi.json").json()
    for path, model in (("/v1/embeddings", "EmbeddingRequest"), ("/encode", "EncodeRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
