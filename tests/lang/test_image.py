"""`sgl.image`: the image token goes into the prompt where the image stands, and every call
carries the state's images: `image_data` in native `/generate` bodies (recorded through
`httpx.MockTransport`), `image_url` content parts in OpenAI chat messages."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from scripted_backend import ScriptedBackend

import sprig as sgl
from sprig.backend import RuntimeEndpoint
from sprig.chat_template import ChatTemplate, get_chat_template
from sprig.runtime.tiny_checkpoint import CHAT_TEMPLATE
from sprig.template_source import from_jinja

# Gemma 3's chat template (the instruction-tuned checkpoints' tokenizer_config.json).
GEMMA3_JINJA = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
MODEL_INFO = {"model_path": "/models/gemma-3-4b-it", "chat_template": GEMMA3_JINJA, "bos_token": "<bos>"}
CAT = b"\x89PNG\r\n\x1a\n" + b"cat pixels"
DOG = b"\xff\xd8\xff\xe0" + b"dog pixels"
TURN = "<start_of_turn>{}\n{}<end_of_turn>\n"
MODEL_TURN = "<start_of_turn>model\n"
GEN = {"max_new_tokens": 64, "stop": ["<end_of_turn>"]}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture
def cat(tmp_path: Path) -> str:
    (tmp_path / "cat.png").write_bytes(CAT)
    return str(tmp_path / "cat.png")


@pytest.fixture
def dog(tmp_path: Path) -> str:
    (tmp_path / "dog.jpg").write_bytes(DOG)
    return str(tmp_path / "dog.jpg")


def meta(prompt_tokens: int = 3, completion_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "cached_tokens": 0,
            "e2e_latency": 0.1, **extra}


class Recorder:
    """A native server: records every `/generate` body. A gen is answered with the
    number of images it carried; a commit, a batched score and a stream as SGLang's."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json=MODEL_INFO)
        body = json.loads(request.content)
        self.bodies.append(body)
        if isinstance(body["text"], list):  # select: score each prefix + choice
            return httpx.Response(200, json=[
                {"text": "", "meta_info": meta(input_token_logprobs=[[-1.0, 1, "\n"], [-0.1 * (i + 1), 2, c]])}
                for i, c in enumerate(t.rsplit("\n", 1)[1] for t in body["text"])])
        if body["sampling_params"].get("max_new_tokens") == 0:
            return httpx.Response(200, json={"text": "", "meta_info": meta(7)})
        answer = f"{len(body.get('image_data', []))} images"
        if body.get("stream"):
            events = [{"text": answer[:n], "meta_info": meta()} for n in (2, len(answer))]
            text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"text": answer, "meta_info": meta()})

    def endpoint(self) -> RuntimeEndpoint:
        return RuntimeEndpoint("http://sprig.test", transport=httpx.MockTransport(self))


@sgl.function
def describe(s, path):
    s += sgl.user(sgl.image(path) + "What is in this picture?")
    s += sgl.assistant(sgl.gen("answer", max_tokens=64))


def test_the_template_of_a_gemma3_server_has_its_image_token() -> None:
    template = from_jinja(GEMMA3_JINJA, bos_token="<bos>")
    assert template.image_token == "<start_of_image>"
    assert template.roles["user"] == ("<start_of_turn>user\n", "<end_of_turn>\n")
    assert get_chat_template("gemma-it").image_token == "<start_of_image>"
    assert from_jinja(CHAT_TEMPLATE).image_token is None  # string contents only
    back = ChatTemplate.from_dict(get_chat_template("gemma-it").to_dict())
    assert back.image_token == "<start_of_image>"


def test_the_example_program_sends_its_image_with_the_token(cat: str) -> None:
    server = Recorder()
    state = describe.run(cat, backend=server.endpoint())
    assert server.bodies == [{
        "text": TURN.format("user", "<start_of_image>What is in this picture?") + MODEL_TURN,
        "sampling_params": GEN,
        "image_data": [b64(CAT)],
    }]
    assert state["answer"] == "1 images"
    assert state.messages()[0] == {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(CAT)}"}},
        {"type": "text", "text": "What is in this picture?"},
    ]}
    assert state.messages()[1] == {"role": "assistant", "content": "1 images"}


def test_each_call_carries_the_images_so_far_in_order(cat: str, dog: str) -> None:
    @sgl.function
    def compare(s):
        s += "Plain text first: " + sgl.gen("none", max_tokens=4)
        s += sgl.user("A " + sgl.image(cat) + " and a " + sgl.image(Path(dog)) + ".")
        s += sgl.assistant(sgl.gen("two", max_tokens=4))
        s += sgl.user(sgl.image(cat) + "Again?")
        s += sgl.assistant(sgl.gen("three", max_tokens=4))

    server = Recorder()
    state = compare.run(backend=server.endpoint())
    first, second, third = server.bodies
    assert "image_data" not in first and state["none"] == "0 images"
    assert second["text"].endswith(TURN.format("user", "A <start_of_image> and a <start_of_image>.") + MODEL_TURN)
    assert second["image_data"] == [b64(CAT), b64(DOG)]
    assert third["text"].count("<start_of_image>") == 3
    assert third["text"].endswith(TURN.format("user", "<start_of_image>Again?") + MODEL_TURN)
    assert third["image_data"] == [b64(CAT), b64(DOG), b64(CAT)]
    assert (state["two"], state["three"]) == ("2 images", "3 images")


def test_urls_are_passed_as_they_are_and_bytes_are_encoded() -> None:
    url, data_url = "https://example.com/cat.png", f"data:image/png;base64,{b64(CAT)}"

    @sgl.function
    def program(s):
        s += sgl.user(sgl.image(url) + sgl.image(data_url) + sgl.image(DOG) + "?")
        s += sgl.assistant(sgl.gen("a", max_tokens=4))

    server = Recorder()
    state = program.run(backend=server.endpoint())
    assert server.bodies[0]["image_data"] == [url, data_url, b64(DOG)]
    parts = state.messages()[0]["content"]
    assert [p["image_url"]["url"] for p in parts[:3]] == [url, data_url, f"data:image/jpeg;base64,{b64(DOG)}"]


def test_forks_keep_their_parents_images(cat: str, dog: str) -> None:
    @sgl.function
    def program(s):
        s += sgl.user(sgl.image(cat) + "Describe it.")
        forks = s.fork(2)
        forks[0] += sgl.user(sgl.image(dog) + "And this?")
        forks += sgl.assistant(sgl.gen("a", max_tokens=4))
        forks.join()
        s += sgl.assistant(sgl.gen("b", max_tokens=4))

    server = Recorder()
    state = program.run(backend=server.endpoint())
    commit, *branches, last = server.bodies
    assert commit == {"text": TURN.format("user", "<start_of_image>Describe it."),
                      "sampling_params": {"max_new_tokens": 0}, "image_data": [b64(CAT)]}
    by_images = sorted(len(b["image_data"]) for b in branches)
    assert by_images == [1, 2]
    for body in branches:
        assert body["image_data"] == [b64(CAT), b64(DOG)][: body["text"].count("<start_of_image>")]
    assert state["a"] == ["2 images", "1 images"]
    assert last["image_data"] == [b64(CAT)] and state["b"] == "1 images"


def test_a_fork_inside_a_role_keeps_the_roles_images(cat: str) -> None:
    @sgl.function
    def program(s):
        s += sgl.user_begin() + sgl.image(cat)
        forks = s.fork(2)
        forks += lambda i: f"Question {i}" + sgl.user_end()
        return forks

    state = program.run(backend=ScriptedBackend([], chat_template=get_chat_template("gemma-it")))
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(CAT)}"}}
    assert [f.messages() for f in state.ret_value] == [
        [{"role": "user", "content": [image, {"type": "text", "text": f"Question {i}"}]}] for i in range(2)]
    assert state.messages() == []


def test_run_batch_keeps_each_programs_images(cat: str, dog: str) -> None:
    @sgl.function
    def program(s, path, name):
        s += sgl.user(sgl.image(path) + f"Is this a {name}?")
        s += sgl.assistant(sgl.gen("a", max_tokens=4))

    server = Recorder()
    items = [{"path": cat, "name": "cat"}, {"path": dog, "name": "dog"}] * 4
    states = program.run_batch(items, backend=server.endpoint(), num_threads=8)
    assert len(server.bodies) == 8 and all(s["a"] == "1 images" for s in states)
    for body in server.bodies:
        expected = b64(CAT) if "a cat?" in body["text"] else b64(DOG)
        assert body["image_data"] == [expected]


def test_a_streamed_run_sends_the_images(cat: str) -> None:
    server = Recorder()
    state = describe.run(cat, backend=server.endpoint(), stream=True)
    assert "".join(state.text_iter("answer")) == "1 images"
    assert server.bodies[0]["stream"] is True
    assert server.bodies[0]["image_data"] == [b64(CAT)]


def test_select_commits_and_scores_with_the_images(cat: str) -> None:
    @sgl.function
    def program(s):
        s += sgl.user(sgl.image(cat) + "Animal?")
        s += sgl.assistant(sgl.select("kind", ["cat", "dog"]))

    server = Recorder()
    state = program.run(backend=server.endpoint())
    commit, scores = server.bodies
    assert commit["image_data"] == [b64(CAT)]
    assert scores["text"] == [commit["text"] + "cat", commit["text"] + "dog"]
    assert scores["image_data"] == [[b64(CAT)], [b64(CAT)]]
    assert state["kind"] == "cat"


# ---------------------------------------------------------------------- the OpenAI backend
class FakeOpenAI:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"id": "c", "usage": {}, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "A cat."}, "finish_reason": "stop"}]})

    def backend(self) -> sgl.OpenAI:
        return sgl.OpenAI("google/gemma-3-4b-it", base_url="http://oai.test/v1", transport=httpx.MockTransport(self))


def test_openai_sends_images_as_content_parts_where_they_stood(cat: str) -> None:
    @sgl.function
    def program(s):
        s += sgl.system("Be brief.")
        s += sgl.user("  Look: " + sgl.image(cat) + " then " + sgl.image("https://x.test/dog.jpg") + " compare.")
        s += sgl.assistant(sgl.gen("a", max_tokens=8))

    fake = FakeOpenAI()
    state = program.run(backend=fake.backend())
    assert fake.bodies[0]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "Look: "},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(CAT)}"}},
            {"type": "text", "text": " then "},
            {"type": "image_url", "image_url": {"url": "https://x.test/dog.jpg"}},
            {"type": "text", "text": " compare."},
        ]},
    ]
    assert state["a"] == "A cat."


def test_openai_example_program(cat: str) -> None:
    fake = FakeOpenAI()
    describe.run(cat, backend=fake.backend())
    assert fake.bodies[0]["messages"] == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(CAT)}"}},
        {"type": "text", "text": "What is in this picture?"},
    ]}]


def test_openai_refuses_images_it_cannot_place(cat: str) -> None:
    @sgl.function
    def outside(s):
        s += sgl.image(cat)
        s += sgl.user("What is this?")
        s += sgl.assistant(sgl.gen("a"))

    with pytest.raises(ValueError, match="outside every role"):
        outside.run(backend=FakeOpenAI().backend())

    @sgl.function
    def completion(s):
        s += sgl.image(cat) + "A picture of" + sgl.gen("a")

    with pytest.raises(ValueError, match="chat API only"):
        completion.run(backend=FakeOpenAI().backend())


# ---------------------------------------------------------------------- errors
def test_a_missing_file_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere.png")
    with pytest.raises(FileNotFoundError, match=r"no image file .*nowhere\.png"):
        describe.run(missing, backend=Recorder().endpoint())


def test_a_template_without_an_image_token_is_named(cat: str) -> None:
    with pytest.raises(ValueError, match="chat template 'default' has no image_token"):
        describe.run(cat, backend=ScriptedBackend(["x"]))


def test_images_work_with_a_template_passed_to_a_scripted_backend(cat: str) -> None:
    backend = ScriptedBackend(["a cat"], chat_template=get_chat_template("gemma-it"))
    state = describe.run(cat, backend=backend)
    prompt = backend.calls[0].prompt
    assert prompt.text == TURN.format("user", "<start_of_image>What is in this picture?") + MODEL_TURN
    assert [i.data for i in prompt.images] == [b64(CAT)]
    assert state["answer"] == "a cat"


def test_video_stays_refused_and_image_takes_paths_urls_or_bytes() -> None:
    with pytest.raises(AttributeError, match="not video"):
        sgl.video  # noqa: B018
    with pytest.raises(TypeError, match="path, a URL or bytes"):
        sgl.image(42)  # type: ignore[arg-type]
    assert "image" in sgl.__all__ and "video" not in sgl.__all__


def test_an_empty_image_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.png' is empty"):
        describe.run(str(tmp_path / "empty.png"), backend=Recorder().endpoint())
