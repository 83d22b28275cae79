"""The real server's /tokenize, /detokenize (SGLang's and vLLM's shapes), /version and
`ebnf` on /generate: answers equal the checkpoint's own tokenizer, bad input is a 400
naming the field, and every route is in /openapi.json."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest
from server_helpers import Server
from transformers import AutoTokenizer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
DIGITS_EBNF = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] [0-9]?\n'


@pytest.fixture(scope="module")
def tok(tiny_llama: Path):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_tokenize_a_prompt_or_several(server: Server, tok) -> None:
    text = "the quick brown fox"
    out = server.post("/tokenize", {"prompt": text}).json()
    assert out == {"tokens": tok.encode(text), "count": len(tok.encode(text)), "max_model_len": 1024}
    bare = server.post("/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False) != out["tokens"]
    assert bare["token_strs"] == tok.convert_ids_to_tokens(bare["tokens"])
    many = server.post("/tokenize", {"prompt": [text, "one", ""], "model": "anything"}).json()
    assert many["tokens"] == [tok.encode(t) for t in (text, "one", "")]
    assert many["count"] == [len(t) for t in many["tokens"]]


def test_tokenize_chat_messages_as_the_template_renders_them(server: Server, tok) -> None:
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    out = server.post("/tokenize", {"messages": MESSAGES}).json()
    assert out["tokens"] == tok.encode(rendered, add_special_tokens=False) and out["count"] == len(out["tokens"])
    plain = tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    out = server.post("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert out["tokens"] == tok.encode(plain, add_special_tokens=False)


def test_detokenize_one_sequence_or_several(server: Server, tok) -> None:
    ids = tok.encode("the quick brown fox")
    out = server.post("/detokenize", {"tokens": ids}).json()
    assert out["text"] == out["prompt"] == tok.decode(ids, skip_special_tokens=True)
    raw = server.post("/detokenize", {"tokens": ids, "skip_special_tokens": False}).json()
    assert raw["text"] == tok.decode(ids) and raw["text"].startswith("<s>")
    many = server.post("/detokenize", {"tokens": [ids, ids[2:], []]}).json()
    assert many["text"] == [tok.decode(s, skip_special_tokens=True) for s in (ids, ids[2:], [])]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": []}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x" * 4_000_000}, "prompt"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 7 * 7 }}"}, "chat_template"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [[1], 2]}, "tokens"),
        ("/detokenize", {"tokens": [0] * ((1 << 20) + 1)}, "tokens"),
    ],
)
def test_bad_token_requests_are_a_400_naming_the_field(server: Server, path, body, param) -> None:
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_version(server: Server) -> None:
    assert server.get("/version").json() == {"version": version("sprig")}


def test_ebnf_on_generate(server: Server) -> None:
    outs = server.generate({"text": [f"numbers {i}:" for i in range(4)],
                            "sampling_params": [{"ebnf": DIGITS_EBNF, "max_new_tokens": 64, "temperature": 1.0,
                                                 "sampling_seed": i} for i in range(4)]})
    for out in outs:
        text = out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert text.startswith("(") and text.endswith(")"), text
        assert all(n.isdigit() and len(n) <= 2 for n in text[1:-1].split(",")), text


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"ebnf": 'root ::= "a" undefined_rule'}, "ebnf"),
        ({"ebnf": "start: /[/"}, "ebnf"),
        ({"ebnf": ""}, "ebnf must be"),
        ({"ebnf": "r" * (64 * 1024 + 1)}, "ebnf must be"),
        ({"ebnf": 'root ::= "a"', "regex": "a"}, "regex and ebnf are mutually exclusive"),
    ],
)
def test_a_bad_ebnf_is_a_400(server: Server, params, message) -> None:
    r = server.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, **params}})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"], r.text
    server.wait_idle()


def test_the_routes_are_in_the_openapi_document(server: Server) -> None:
    doc = server.get("/openapi.json").json()
    for path, method in [("/tokenize", "post"), ("/detokenize", "post"), ("/version", "get"),
                         ("/server_info", "get"), ("/get_server_info", "get")]:
        assert method in doc["paths"][path], path
    schemas = doc["components"]["schemas"]
    assert {"prompt", "messages", "add_special_tokens"} <= schemas["TokenizeRequest"]["properties"].keys()
    assert "tokens" in schemas["DetokenizeRequest"]["required"]
