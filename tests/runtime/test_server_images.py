"""Images through the real server on a tiny Gemma 3 vision-language checkpoint: SGLang's
`/generate` with `image_data` (base64, data URLs, local paths only under
--allowed-local-media-path, batches), the official `openai` client's chat with
`image_url` parts, the same greedy tokens as the offline Engine, and every bad input a
400 naming its field with nothing left running."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import Server, running_server
from vision_checkpoint import build_vision_checkpoint, random_image

from sprig.runtime import Engine

openai = pytest.importorskip("openai")

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
SGLANG = Path(os.environ.get("SGLANG_ENV", Path(__file__).parents[2] / ".venv-sglang")) / "bin" / "python"
# SGLang's own frontend: its template for the server's model path ("gemma-it") puts
# `<start_of_image>` where sgl.image stands and sends the file's base64 as image_data
SGLANG_PROGRAM = """
import json, sys
import sglang as sgl

@sgl.function
def describe(s, path):
    s += sgl.user(sgl.image(path) + "What is in this picture?")
    s += sgl.assistant(sgl.gen("answer", max_tokens=6, temperature=0, ignore_eos=True))

state = describe.run(path=sys.argv[2], backend=sgl.RuntimeEndpoint(sys.argv[1]))
print(json.dumps({"answer": state["answer"], "text": state.text(), "meta": state.get_meta_info("answer")}))
"""
PROMPT = "Describe <start_of_image> briefly."


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    random_image(seed).save(buf, format="PNG")
    return buf.getvalue()


def b64(seed: int) -> str:
    return base64.b64encode(png(seed)).decode()


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Its directory's name is one SGLang's frontend matches to its Gemma template."""
    return build_vision_checkpoint(tmp_path_factory.mktemp("models") / "tiny-gemma-3-it")


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("media")
    (d / "one.png").write_bytes(png(1))
    return d


@pytest.fixture(scope="module")
def server(vision: Path, media: Path) -> Iterator[Server]:
    with running_server(vision, "--allowed-local-media-path", str(media), "--disable-media-urls") as s:
        yield s


def answer(out: dict) -> tuple[list[int], list[float]]:
    return out["output_ids"], [round(lp, 4) for lp, *_ in out["meta_info"]["output_token_logprobs"]]


@pytest.fixture(scope="module")
def offline(vision: Path) -> dict[int, tuple[list[int], list[float]]]:
    """The offline Engine's greedy tokens and their logprobs for PROMPT with images of seeds 1 and 2."""
    with Engine(str(vision), dtype="float32", device="cpu") as e:
        return {s: answer(e.generate(PROMPT, GREEDY, image_data=random_image(s), return_logprob=True))
                for s in (1, 2)}


@pytest.fixture(autouse=True)
def intact_after(server: Server) -> Iterator[None]:
    yield
    server.wait_idle()


def test_model_info_says_it_takes_images(server: Server) -> None:
    info = server.get("/get_model_info").json()
    assert info["has_image_understanding"] is True and info["has_audio_understanding"] is False


def test_generate_takes_image_data_in_every_form(server: Server, media: Path, offline: dict) -> None:
    for image in (b64(1), "data:image/png;base64," + b64(1), str(media / "one.png"), (media / "one.png").as_uri(),
                  [b64(1)]):
        out = server.generate({"text": PROMPT, "image_data": image, "sampling_params": GREEDY, "return_logprob": True})
        assert answer(out) == offline[1], image[:40]
    batch = server.generate({"text": [PROMPT, PROMPT], "image_data": [b64(2), [b64(1)]], "sampling_params": GREEDY,
                             "return_logprob": True})
    assert [answer(o) for o in batch] == [offline[2], offline[1]]
    assert offline[1] != offline[2]


def test_openai_chat_with_image_parts(server: Server, vision: Path) -> None:
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(2), "detail": "low"}},
        {"type": "text", "text": "What is this?"}]}]
    with Engine(str(vision), dtype="float32", device="cpu") as e:
        text = e.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
            tokenize=False, add_generation_prompt=True)
        want = e.generate(text.removeprefix(e.tokenizer.bos_token), GREEDY, image_data=random_image(2))
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60.0, max_retries=0) as client:
        got = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0.0,
                                             extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want["text"]
    assert got.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]
    counted = server.post("/tokenize", {"messages": messages, "add_special_tokens": False}).json()
    assert counted["count"] == got.usage.prompt_tokens  # each image's placeholders counted


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"text": PROMPT, "image_data": "%%%"}, "image_data", "image_data[0]"),
    ({"text": PROMPT, "image_data": [b64(1), b64(2)]}, "image_data", "1 image placeholders (<start_of_image>) for 2 images"),
    ({"text": PROMPT, "image_data": "/etc/passwd"}, "image_data", "allowed-local-media-path"),
    ({"text": PROMPT, "image_data": "http://127.0.0.1:9/x.png"}, "image_data", "URL"),
    ({"text": [PROMPT, PROMPT], "image_data": [b64(1)]}, "image_data", "one entry per prompt"),
    ({"text": PROMPT, "image_data": base64.b64encode(b"not an image").decode()}, "image_data", "image"),
])
def test_bad_images_are_a_400_naming_the_field(server: Server, body: dict, field: str, words: str) -> None:
    r = server.post("/generate", {**body, "sampling_params": GREEDY})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and words in err["message"], err


def test_chat_image_errors_name_messages(server: Server) -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}},
                                             {"type": "text", "text": "hi"}]}]
    r = server.post("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_an_sgl_image_program_runs_on_the_server(server: Server, vision: Path, media: Path) -> None:
    """SGLang's frontend program with `sgl.image`, unchanged, against the server: the
    image reaches the model (its answer is the offline Engine's for the same prompt)."""
    import sprig as sgl

    @sgl.function
    def describe(s, path):
        s += sgl.user(sgl.image(path) + "What is in this picture?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=6, temperature=0.0, ignore_eos=True))

    backend = sgl.RuntimeEndpoint(server.url)
    state = describe.run(path=str(media / "one.png"), backend=backend)
    with Engine(str(vision), dtype="float32", device="cpu") as e:
        text = e.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}],
            tokenize=False, add_generation_prompt=True)
        want = e.generate(text.removeprefix(e.tokenizer.bos_token), GREEDY, image_data=random_image(1))
    assert state["answer"] == want["text"]


def test_responses_input_image(server: Server, vision: Path) -> None:
    """`/v1/responses` takes `input_image` parts as chat takes `image_url` parts."""
    chat = server.post("/v1/chat/completions", {"model": "m", "max_tokens": 6, "temperature": 0.0,
                                                "messages": [{"role": "user", "content": [
                                                    {"type": "text", "text": "Look:"},
                                                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(2)}}]}]})
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60.0, max_retries=0) as client:
        got = client.responses.create(model="m", max_output_tokens=6, temperature=0.0,
                                      input=[{"role": "user", "content": [
                                          {"type": "input_text", "text": "Look:"},
                                          {"type": "input_image", "image_url": "data:image/png;base64," + b64(2)}]}])
    assert chat.status_code == 200, chat.text
    assert got.output_text == chat.json()["choices"][0]["message"]["content"]
    assert got.usage.input_tokens == chat.json()["usage"]["prompt_tokens"]


@pytest.mark.skipif(not SGLANG.is_file(), reason="no SGLang environment: build it with `bash scripts/sglang_env.sh`")
def test_sglangs_frontend_sends_an_image(server: Server, vision: Path, media: Path) -> None:
    """SGLang's real frontend, `sgl.image` and all, against the server: the answer is the
    offline Engine's for the text SGLang rendered, with the image."""
    done = subprocess.run([str(SGLANG), "-c", SGLANG_PROGRAM, server.url, str(media / "one.png")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    prompt = "<start_of_turn>user\n<start_of_image>What is in this picture?<end_of_turn>\n<start_of_turn>model\n"
    assert got["text"] == prompt + got["answer"] + "<end_of_turn>\n"
    with Engine(str(vision), dtype="float32", device="cpu") as e:
        want = e.generate(prompt, GREEDY, image_data=random_image(1))
    assert got["answer"] == want["text"] and got["meta"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
