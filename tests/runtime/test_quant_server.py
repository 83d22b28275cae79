"""Quantized weights through `sprig serve`: the flags, a real server on a GPTQ checkpoint
and on online int4 weights (greedy outputs equal transformers' on the weights the codes
stand for), and an unsupported method failing start-up with its name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from quant_checkpoints import Spec, quantize_checkpoint, with_rtn_weights
from server_helpers import running_server
from transformers import AutoModelForCausalLM

from sprig.runtime.cli import build_parser, configs_from_args
from sprig.runtime.quantization.weight import QuantScheme

MAX_NEW = 8


def parse(*flags: str):
    return configs_from_args(build_parser().parse_args(["serve", "--model", "/m", *flags]))


def test_flags_reach_the_runner_config() -> None:
    _, engine = parse("--quantization", "int4", "--quantization-group-size", "64")
    assert (engine.runner.quantization, engine.runner.quantization_group_size) == ("int4", 64)
    _, engine = parse()
    assert (engine.runner.quantization, engine.runner.quantization_group_size) == (None, 128)


@pytest.mark.parametrize("flags", [["--quantization", "int3"], ["--quantization-group-size", "48"]])
def test_invalid_flags(flags: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        parse(*flags)
    assert "invalid choice" in capsys.readouterr().err


def _greedy(hf: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for ids in prompts:
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                              pad_token_id=hf.config.eos_token_id)
        out.append(gen[0, len(ids):].tolist())
    return out


PROMPTS = [[5, 9, 33, 41, 7], [100, 3, 3, 250], [17] * 11]


def _served(path: Path, *flags: str) -> list[list[int]]:
    with running_server(path, *flags) as server:
        body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
        outs = server.generate(body)
        server.wait_idle()
    return [o["output_ids"] for o in outs]


def _same_until_eos(got: list[list[int]], want: list[list[int]]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g[: len(w)] == w  # transformers stops early only at an eos


def test_server_on_a_gptq_checkpoint(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    quantized, dequantized = quantize_checkpoint(tiny_checkpoints["qwen2"], tmp_path, Spec("gptq", 4, 32, sym=False, act_order=True))
    hf = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    _same_until_eos(_served(quantized), _greedy(hf, PROMPTS))


def test_server_with_online_int4(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["llama"]
    hf = with_rtn_weights(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), QuantScheme(4, 32, symmetric=False))
    _same_until_eos(_served(path, "--quantization", "int4", "--quantization-group-size", "32"), _greedy(hf, PROMPTS))


def test_unsupported_method_fails_startup_naming_it(tiny_llama: Path, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    for f in tiny_llama.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (path / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "sprig.runtime", "serve", "--model", str(path), "--port", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1
    assert "quantization method 'bitsandbytes' is not supported" in proc.stderr.splitlines()[-1]
