"""LoRA adapters behind HTTP: `sprig serve --lora-paths`, `lora_path` on `/generate` (one
per prompt of a batch) and the OpenAI routes, the adapter as the OpenAI `model` (vLLM's
"ADAPTER", SGLang's "MODEL:ADAPTER") with the official client, adapters in `/v1/models`,
and `/load_lora_adapter` / `/unload_lora_adapter` while serving; greedy tokens equal PEFT's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from engine_helpers import make_prompts
from lora_adapters import peft_adapter, peft_greedy
from server_helpers import Server, running_server

PROMPTS = make_prompts(3, seed=31)
NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-server")
    return {
        "attn": peft_adapter(tiny_llama, root / "attn", seed=1, targets=["q_proj", "v_proj", "o_proj"], scale=20.0),
        "mlp": peft_adapter(tiny_llama, root / "mlp", seed=2, targets=["gate_proj", "down_proj"], r=4, scale=20.0),
    }


@pytest.fixture(scope="module")
def refs(tiny_llama: Path, adapters: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    return {name: peft_greedy(tiny_llama, path, PROMPTS, NEW) for name, path in [(None, None), *adapters.items()]}


@pytest.fixture(scope="module")
def lora_server(tiny_llama: Path, adapters: dict[str, Path]) -> Iterator[Server]:
    with running_server(tiny_llama, "--lora-paths", f"attn={adapters['attn']}", "--max-loras-per-batch", "2",
                        "--lora-target-modules", "all", "--max-lora-rank", "8") as s:
        yield s


def generate(server: Server, lora_path) -> list[list[int]]:
    body = {"text": PROMPTS, "sampling_params": {"max_new_tokens": NEW, "temperature": 0}, "lora_path": lora_path}
    return [o["output_ids"] for o in server.generate(body)]


def test_generate_runs_each_prompt_with_its_adapter(lora_server: Server, refs) -> None:
    server = lora_server
    log = server.log.read_text()
    assert "LoRA: 2 adapter slots of rank 8 on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj; " \
           "loaded: attn" in log
    assert generate(server, "attn") == refs["attn"]
    assert generate(server, [None, "attn", None]) == [refs[None][0], refs["attn"][1], refs[None][2]]
    r = server.post("/generate", {"text": "hi", "lora_path": "mlp"})
    assert r.status_code == 400 and "no LoRA adapter named 'mlp' is loaded (loaded: 'attn')" in r.text
    r = server.post("/generate", {"text": ["a", "b"], "lora_path": ["attn"]})
    assert r.status_code == 400 and "lora_path must be an adapter name or a list of 2" in r.text
    server.wait_idle()


def test_openai_clients_name_the_adapter_as_the_model(lora_server: Server, refs) -> None:
    server = lora_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    base = client.models.list().data[0].id
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {base, "attn"} and cards["attn"].parent == base
    texts = {}
    for model, extra in [(base, {}), ("attn", {}), (f"{base}:attn", {}), (base, {"lora_path": "attn"})]:
        out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                        extra_body=extra)
        texts[(model, tuple(extra))] = out.choices[0].text
    plain = server.generate({"text": PROMPTS[0], "sampling_params": {"max_new_tokens": NEW, "temperature": 0}})
    with_attn = server.generate({"text": PROMPTS[0], "sampling_params": {"max_new_tokens": NEW, "temperature": 0},
                                 "lora_path": "attn"})
    assert with_attn["output_ids"] == refs["attn"][0] and with_attn["text"] != plain["text"]
    assert texts[(base, ())] == plain["text"]
    assert texts[("attn", ())] == texts[(f"{base}:attn", ())] == texts[(base, ("lora_path",))] == with_attn["text"]
    chat = client.chat.completions.create(model="attn", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=4, temperature=0)
    assert chat.choices[0].message.content is not None
    messages = [{"role": "user", "content": "hello there"}]
    chats = {m: client.chat.completions.create(model=m, messages=messages, max_tokens=6, temperature=0)
             .choices[0].message.content for m in (base, "attn")}
    assert chats[base] != chats["attn"]
    for m in (base, "attn"):  # the Responses API names the adapter the same way
        assert client.responses.create(model=m, input=messages, max_output_tokens=6, temperature=0).output_text \
            == chats[m]
    vectors = {m: client.embeddings.create(model=m, input=PROMPTS[0]).data[0].embedding for m in (base, "attn")}
    native = server.post("/encode", {"text": PROMPTS[0], "lora_path": "attn"}).json()["embedding"]
    assert vectors["attn"] == pytest.approx(native, abs=1e-6) and vectors["attn"] != pytest.approx(vectors[base], abs=1e-3)
    with pytest.raises(openai.BadRequestError, match="no LoRA adapter named 'nope' is loaded"):
        client.chat.completions.create(model=f"{base}:nope", messages=[{"role": "user", "content": "hi"}])
    server.wait_idle()


def test_adapters_load_and_unload_while_serving(lora_server: Server, adapters: dict[str, Path], refs,
                                                tmp_path: Path) -> None:
    server = lora_server
    r = server.post("/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(adapters["mlp"])})
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True, "error_message": None,
                        "loaded_adapters": {"attn": str(adapters["attn"]), "mlp": str(adapters["mlp"])}}
    assert generate(server, "mlp") == refs["mlp"]
    assert {m["id"] for m in server.get("/v1/models").json()["data"]} >= {"attn", "mlp"}
    full = server.post("/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["mlp"])})
    assert full.status_code == 400 and "all 2 LoRA slots" in full.json()["error_message"]
    r = server.post("/unload_lora_adapter", {"lora_name": "mlp"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {"attn": str(adapters["attn"])}
    missing = server.post("/load_lora_adapter", {"lora_name": "y", "lora_path": str(tmp_path)})
    assert missing.status_code == 400 and "not a PEFT LoRA adapter" in missing.json()["error_message"]
    assert server.post("/generate", {"text": "hi", "lora_path": "mlp"}).status_code == 400
    assert "mlp" not in {m["id"] for m in server.get("/v1/models").json()["data"]}
    assert server.post("/unload_lora_adapter", {}).status_code == 400  # lora_name is required
    server.wait_idle()


def test_lora_is_refused_where_not_enabled(server: Server, adapters: dict[str, Path]) -> None:
    """The session's plain server (no --lora-paths)."""
    r = server.post("/generate", {"text": "hi", "lora_path": "attn"})
    assert r.status_code == 400 and "LoRA is not enabled" in r.text
    r = server.post("/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["attn"])})
    assert r.status_code == 400 and r.json()["error_message"].startswith("LoRA is not enabled")
    server.wait_idle()
