"""Request fields of other OpenAI-compatible servers on the real server: vLLM's structured
outputs (legacy `guided_*` and `structured_outputs`) constrain the output, fields sprig
does not honour are a 400 naming them (never silently ignored), `GET /v1/models/{id}`,
`echo` text offsets, `continue_final_message` / `add_generation_prompt`,
`parallel_tool_calls` and `include_stop_str_in_output`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from server_helpers import Server
from transformers import AutoTokenizer

PROMPT = "what is the capital of France ?"
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"]}


@pytest.fixture(autouse=True)
def intact_after(server: Server):
    yield
    server.wait_idle()


def post(server: Server, path: str, **body) -> dict:
    base = {"messages": MESSAGES} if path == "/v1/chat/completions" else {"prompt": PROMPT}
    r = server.post(path, {**base, "max_tokens": 40, "temperature": 1.0, "seed": 5, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def refused(server: Server, path: str, **body) -> dict:
    base = {"messages": MESSAGES} if path == "/v1/chat/completions" else {"prompt": PROMPT}
    r = server.post(path, {**base, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


PATHS = ["/v1/chat/completions", "/v1/completions"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("field", [{"guided_json": SCHEMA}, {"structured_outputs": {"json": SCHEMA}},
                                   {"guided_json": json.dumps(SCHEMA)}])
def test_json_fields_constrain_to_the_schema(server: Server, path: str, field: dict) -> None:
    jsonschema.validate(json.loads(post(server, path, **field)), SCHEMA)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("field", "check"), [
    ({"guided_regex": "[a-c]{3}x"}, lambda t: re.fullmatch("[a-c]{3}x", t)),
    ({"structured_outputs": {"regex": "[0-9]{4}"}}, lambda t: re.fullmatch("[0-9]{4}", t)),
    ({"guided_choice": ["yes", "no", "a.b (c)"]}, lambda t: t in ("yes", "no", "a.b (c)")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": "\n"}, lambda t: "\n" in t and json.loads(t)),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, lambda t: json.loads(t)["city"]),
])
def test_vllm_constraints_constrain(server: Server, path: str, field: dict, check) -> None:
    text = post(server, path, **field)
    assert check(text), text


@pytest.mark.parametrize("field", [{"guided_grammar": 'root ::= "yes" | "no"'},
                                   {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}])
def test_grammar_fields_are_ebnf(server: Server, field: dict) -> None:
    native = server.post("/generate", {"text": PROMPT, "sampling_params": {"ebnf": 'root ::= "yes" | "no"',
                                                                         "max_new_tokens": 8}})
    if native.status_code == 400:  # the server has no grammar backend: the field is refused, named
        error = refused(server, "/v1/chat/completions", **field)
        assert error["param"] == next(iter(field)) and "ebnf" in error["message"]
    else:
        assert post(server, "/v1/chat/completions", **field) in ("yes", "no")


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"guided_json": SCHEMA, "guided_regex": "x"}, "guided_regex", "one constraint"),
    ({"regex": "x", "structured_outputs": {"regex": "y"}}, "structured_outputs", "one constraint"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "one constraint"),
    ({"structured_outputs": {"regex": "x", "choice": ["a"]}}, "structured_outputs", "one constraint"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs", "jsonn"),
    ({"guided_choice": []}, "guided_choice", "at least one"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "guided_json"),
    ({"guided_regex": "(?=a)b"}, "guided_regex", "lookahead"),
    ({"guided_json": {"type": "object", "not": {}}}, "guided_json", "not"),
    ({"best_of": 3}, "best_of", "use n"),
    ({"use_beam_search": True}, "use_beam_search", "beam"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"function_call": "auto"}, "function_call", "tool_choice"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "--chat-template"),
    ({"logits_processors": ["x"]}, "logits_processors", "client code"),
    ({"modalities": ["text", "audio"]}, "modalities", "only text"),
    ({"echo": True}, "echo", "/v1/completions"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "takes no reasoning effort"),
    ({"include_stop_str_in_output": True, "no_stop_trim": False}, "include_stop_str_in_output", "not both"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message", "both"),
])
def test_fields_that_would_change_the_output_are_never_ignored(server: Server, body: dict, param: str,
                                                                needle: str) -> None:
    error = refused(server, "/v1/chat/completions", **body)
    assert error["param"] == param and needle in error["message"], error


def test_fields_that_change_nothing_are_accepted(server: Server) -> None:
    harmless = {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "best_of": 1,
                "modalities": ["text"], "use_beam_search": False, "prediction": {"type": "content", "content": "x"},
                "stream_reasoning": True, "parallel_tool_calls": True}
    assert post(server, "/v1/chat/completions", temperature=0, **harmless) == post(server, "/v1/chat/completions",
                                                                                  temperature=0)
    assert post(server, "/v1/completions", n=2, best_of=2) is not None
    assert refused(server, "/v1/completions", add_special_tokens=False)["param"] == "add_special_tokens"


def test_include_stop_str_in_output(server: Server) -> None:
    free = post(server, "/v1/completions", temperature=0, max_tokens=12, ignore_eos=True)
    stop = free[3:5]
    kept = post(server, "/v1/completions", temperature=0, stop=[stop], include_stop_str_in_output=True)
    trimmed = post(server, "/v1/completions", temperature=0, stop=[stop])
    assert kept == trimmed + stop and kept.endswith(stop) and free.startswith(kept)


@pytest.mark.parametrize("path", PATHS)
def test_stop_regex_ends_the_text_where_it_matches(server: Server, path: str) -> None:
    free = post(server, path, temperature=0, max_tokens=12, ignore_eos=True)
    pattern = re.escape(free[3:5])
    stopped = post(server, path, temperature=0, max_tokens=12, ignore_eos=True, stop_regex=pattern)
    assert stopped == free[: re.search(pattern, free).start()]
    assert "stop_regex" in refused(server, path, stop_regex="(")["message"]


def test_a_model_by_id(server: Server, tiny_llama: Path) -> None:
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        card = client.models.retrieve(tiny_llama.name)
        assert (card.id, card.object, card.owned_by) == (tiny_llama.name, "model", "sprig")
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-4o")
    r = server.get("/v1/models/gpt-4o")
    assert r.status_code == 404
    assert r.json()["error"] | {"message": ""} == {"message": "", "type": "not_found_error", "param": "model",
                                                   "code": 404}


def test_echo_text_offsets_point_into_the_text(server: Server, tiny_llama: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    r = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True,
                                        "logprobs": 1})
    choice = r.json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert lp["tokens"][0] == tok.bos_token and lp["text_offset"][:2] == [0, 0]  # BOS: not in the text
    for token, offset in zip(lp["tokens"][1:], lp["text_offset"][1:], strict=True):
        assert text[offset:offset + len(token)] == token, (token, offset)


def render(tok, messages: list[dict], **kw) -> int:
    text = tok.apply_chat_template(messages, tokenize=False, **kw)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_continue_final_message(server: Server, tiny_llama: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    messages = [*MESSAGES, {"role": "assistant", "content": "the answer is"}]
    body = {"messages": messages, "max_tokens": 3, "temperature": 0}
    cont = server.post("/v1/chat/completions", {**body, "continue_final_message": True,
                                                "add_generation_prompt": False}).json()
    assert cont["usage"]["prompt_tokens"] == render(tok, messages, continue_final_message=True)
    implied = server.post("/v1/chat/completions", {**body, "continue_final_message": True}).json()
    assert implied["usage"]["prompt_tokens"] == cont["usage"]["prompt_tokens"]
    assert implied["choices"][0]["message"] == cont["choices"][0]["message"]
    closed = server.post("/v1/chat/completions", {**body, "add_generation_prompt": False}).json()
    assert closed["usage"]["prompt_tokens"] == render(tok, messages, add_generation_prompt=False)
    opened = server.post("/v1/chat/completions", body).json()
    assert opened["usage"]["prompt_tokens"] == render(tok, messages, add_generation_prompt=True)
    assert len({cont["usage"]["prompt_tokens"], closed["usage"]["prompt_tokens"],
                opened["usage"]["prompt_tokens"]}) == 3
    empty = server.post("/v1/chat/completions", {**body, "messages": [*MESSAGES, {"role": "assistant", "content": ""}],
                                                 "continue_final_message": True})
    assert empty.status_code == 400 and "continue the final message" in empty.json()["error"]["message"]


def test_parallel_tool_calls_false_keeps_one_call(server: Server) -> None:
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    two = ('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
           '<tool_call>\n{"name": "get_weather", "arguments": {"x": 1}}\n</tool_call>')
    body = {"messages": MESSAGES, "max_tokens": 200, "temperature": 0, "tools": [weather], "regex": re.escape(two)}
    both = server.post("/v1/chat/completions", body).json()["choices"][0]["message"]["tool_calls"]
    one = server.post("/v1/chat/completions", {**body, "parallel_tool_calls": False}).json()
    assert len(both) == 2 and [c["function"] for c in one["choices"][0]["message"]["tool_calls"]] == [
        both[0]["function"]]
