"""`sprig serve --served-model-name --chat-template --context-length` on the real server,
and the `sprig` command itself: `--version`, and a bare `sprig` printing its help."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import jinja2
import openai
import pytest
from server_helpers import running_server
from transformers import AutoTokenizer

TEMPLATE = (
    "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)
MESSAGES = [{"role": "user", "content": "name a color"}]


def test_served_model_name_chat_template_and_context_length(tiny_llama: Path, tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    rendered = jinja2.Template(TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)
    with running_server(tiny_llama, "--served-model-name", "my-model", "--chat-template", str(template),
                        "--context-length", "96") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60)
        [model] = client.models.list().data
        assert model.id == "my-model" and model.model_dump()["max_model_len"] == 96
        info = server.get("/get_model_info").json()
        assert info["served_model_name"] == "my-model" and info["chat_template"] == TEMPLATE
        assert info["context_len"] == 96 and server.info()["model"]["context_len"] == 96

        chat = client.chat.completions.create(model="my-model", messages=MESSAGES, max_tokens=4, temperature=0)
        assert chat.model == "my-model"
        assert chat.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
        assert server.post("/tokenize", {"messages": MESSAGES}).json() == {
            "tokens": tok.encode(rendered, add_special_tokens=False),
            "count": chat.usage.prompt_tokens, "max_model_len": 96,
        }

        ids = tok.encode("the quick brown fox " * 6)
        assert len(ids) + 80 > 96
        r = server.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 80}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_new_tokens", r.text
        assert "context length 96" in r.json()["error"]["message"]
        fits = server.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 96 - len(ids)}})
        assert fits["meta_info"]["completion_tokens"] == 96 - len(ids)


def test_a_context_length_past_the_rope_config_stops_the_server(tiny_llama: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "sprig.runtime", "serve", "--model", str(tiny_llama), "--port", "0",
                          "--dtype", "float32", "--context-length", "4096"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-2000:]
    assert ("context_length 4096 exceeds the longest context this model supports: 1024 tokens "
            "(max_position_embeddings 1024)") in run.stderr.splitlines()[-1]


@pytest.mark.parametrize("args", [[], ["--version"], ["-v"]])
def test_the_sprig_command(args: list[str]) -> None:
    run = subprocess.run([sys.executable, "-m", "sprig.runtime", *args], check=False, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    if args:
        assert run.stdout.strip() == version("sprig")
    else:
        assert run.stdout.startswith("usage: sprig") and "serve" in run.stdout and "--version" in run.stdout
