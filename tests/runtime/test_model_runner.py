"""ModelRunner plumbing: config validation, KV sizing, step metadata, the attention
registry, and weight-loading errors that name the file and the tensor."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_helpers import contexts_step
from safetensors.torch import load_file, save_file

from sprig.runtime import model_runner
from sprig.runtime.attention import backend_class
from sprig.runtime.attention.cpu import TorchAttentionBackend
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import ForwardStep
from sprig.runtime.model_runner import CPU_DEFAULT_TOKENS, CUDA_CPU_THREADS, ModelRunner
from sprig.runtime.runner_config import RunnerConfig


@pytest.fixture(scope="module")
def runner(tiny_llama: Path) -> ModelRunner:
    return ModelRunner(RunnerConfig(tiny_llama, device="cpu", max_total_tokens=256))


def extend(ids: list[list[int]], slots: list[torch.Tensor], logits_from: list[int]) -> ForwardStep:
    return contexts_step(
        ForwardMode.EXTEND, [t for p in ids for t in p], [len(p) for p in ids], slots, logits_from
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model_path": ""}, "model_path"),
        ({"dtype": "float64"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"device": "not a device"}, "invalid device"),
        ({"attention_backend": "flash"}, "attention_backend"),
        ({"page_size": 0}, "page_size"),
        ({"page_size": 8, "max_total_tokens": 4}, "max_total_tokens"),
        ({"mem_fraction_static": 0.0}, "mem_fraction_static"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
        ({"cpu_threads": 0}, "cpu_threads"),
        ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs"),
    ],
)
def test_runner_config_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RunnerConfig(**{"model_path": "/x", **kwargs})


def test_cpu_threads_sets_torch_threads(tiny_llama: Path) -> None:
    before = torch.get_num_threads()
    try:
        ModelRunner(RunnerConfig(tiny_llama, device="cpu", max_total_tokens=64, cpu_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.gpu
def test_cuda_runner_keeps_torch_to_few_cpu_threads(tiny_llama: Path) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(CUDA_CPU_THREADS + 1)
        ModelRunner(RunnerConfig(tiny_llama, device="cuda", max_total_tokens=64))
        assert torch.get_num_threads() == CUDA_CPU_THREADS
        ModelRunner(RunnerConfig(tiny_llama, device="cuda", max_total_tokens=64, cpu_threads=3))
        assert torch.get_num_threads() == 3
        ModelRunner(RunnerConfig(tiny_llama, device="cpu", max_total_tokens=64))
        assert torch.get_num_threads() == 3  # on the CPU, None leaves torch's setting alone
    finally:
        torch.set_num_threads(before)


def test_runner_resolves_auto_and_sizes_kv(tiny_llama: Path) -> None:
    r = ModelRunner(RunnerConfig(tiny_llama, device="cpu"))
    assert (r.device, r.dtype, r.attention_backend) == (torch.device("cpu"), torch.float32, "torch")
    assert isinstance(r.backend, TorchAttentionBackend)
    assert r.num_slots == CPU_DEFAULT_TOKENS  # 16384 tiny tokens fit the CPU byte budget
    paged = ModelRunner(RunnerConfig(tiny_llama, device="cpu", page_size=8, max_total_tokens=100))
    assert paged.num_slots == 96 and paged.kv_cache.page_size == 8
    assert paged.kv_cache.k[0].shape == (96 + 8, 2, 16)  # usable slots + the padding page


def test_a_half_dtype_that_this_cpu_multiplies_slowly_is_logged(tiny_llama: Path, monkeypatch, caplog) -> None:
    """On CPU a half dtype is timed against float32 once as the model loads; over
    `CPU_SLOW_HALF` times slower (AVX2-only CPUs: tens of times) is a warning that names
    the dtype and the way out. float32 and quantized weights are never timed."""
    timed = []
    monkeypatch.setattr(model_runner, "matmul_slowdown", lambda dtype, *shape: timed.append(dtype) or 30.0)
    with caplog.at_level("WARNING", logger="sprig.runtime.model_runner"):
        ModelRunner(RunnerConfig(tiny_llama, device="cpu", max_total_tokens=64))
        assert not timed and not caplog.records
        ModelRunner(RunnerConfig(tiny_llama, device="cpu", dtype="bfloat16", max_total_tokens=64))
        assert timed == [torch.bfloat16] and "bfloat16" in caplog.text and "--dtype float32" in caplog.text
        caplog.clear()
        monkeypatch.setattr(model_runner, "matmul_slowdown", lambda dtype, *shape: timed.append(dtype) or 0.9)
        ModelRunner(RunnerConfig(tiny_llama, device="cpu", dtype="float16", max_total_tokens=64))
        ModelRunner(RunnerConfig(tiny_llama, device="cpu", dtype="bfloat16", quantization="int8", max_total_tokens=64))
        assert not caplog.records and timed == [torch.bfloat16, torch.float16]


def test_logits_from_selects_rows(runner: ModelRunner) -> None:
    ids = [[5, 6, 7, 8, 9], [10, 11, 12]]
    slots = [torch.arange(1, 6), torch.arange(6, 9)]
    full = runner.forward(extend(ids, slots, [0, 0]))  # [8, V]
    some = runner.forward(extend(ids, slots, [3, 2]))  # rows 3, 4 of request 0; row 2 of 1
    torch.testing.assert_close(some, full[[3, 4, 7]], atol=1e-6, rtol=0)


def test_slot_placement_and_page_size_do_not_change_logits(tiny_llama: Path, runner: ModelRunner) -> None:
    ids = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    ref = runner.forward(extend(ids, [torch.arange(1, 8), torch.arange(8, 11)], [0, 0]))
    paged = ModelRunner(RunnerConfig(tiny_llama, device="cpu", page_size=4, max_total_tokens=64))
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0)) + 4  # scattered slots
    got = paged.forward(extend(ids, [perm[:7], perm[7:10]], [0, 0]))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"q_lens": []}, "at least one request"),
        ({"logits_from": [0, 0, 0]}, "one entry per request"),
        ({"input_ids": [1, 2]}, "sum"),
        ({"q_lens": [0, 3]}, "q_len 0"),
        ({"kv_lens": [1, 4]}, "kv slots < q_len"),
        ({"kv_indices": torch.arange(1, 6).float()}, "integer CPU"),
        ({"kv_indices": torch.arange(1, 6)[None]}, "1-D"),
        ({"kv_indices": torch.arange(1, 5)}, "sum"),
        ({"logits_from": [2, 0]}, "logits_from 2"),
    ],
)
def test_forward_step_rejects(kwargs: dict, message: str) -> None:
    fields = {
        "mode": ForwardMode.EXTEND, "input_ids": [1, 2, 3], "q_lens": [2, 1],
        "kv_lens": [2, 3], "kv_indices": torch.arange(1, 6), "logits_from": [1, 0],
    }
    with pytest.raises(ValueError, match=message):
        ForwardStep(**{**fields, **kwargs})


def test_decode_step_needs_one_token_each() -> None:
    with pytest.raises(ValueError, match="decode"):
        contexts_step(ForwardMode.DECODE, [1, 2], [2], [torch.arange(1, 3)], [1])


def test_forward_rejects_bad_slots_and_overlong_context(runner: ModelRunner) -> None:
    with pytest.raises(ValueError, match="out of range"):
        runner.forward(extend([[5, 6]], [torch.tensor([1, 257])], [0]))
    too_long = torch.ones(runner.model_config.context_len + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="context_len"):
        runner.forward(contexts_step(ForwardMode.DECODE, [5], [1], [too_long], [0]))


def test_attention_registry_is_lazy_and_reports_names() -> None:
    code = (
        "import sys, sprig.runtime.attention as a; "
        "assert 'triton' not in sys.modules and 'sprig.runtime.attention.triton_backend' "
        "not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert backend_class("torch") is TorchAttentionBackend
    with pytest.raises(ValueError, match="available: torch, triton"):
        backend_class("flash")


# --- weight loading errors: each names the file and the tensor ---------------------------


def copy_checkpoint(src: Path, dst: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """`src`'s config files in `dst`, with `tensors` (default: src's) as model.safetensors."""
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def load(path: Path) -> ModelRunner:
    return ModelRunner(RunnerConfig(path, device="cpu", max_total_tokens=16))


def test_missing_tensor(tiny_llama: Path, tmp_path: Path) -> None:
    tensors = load_file(str(tiny_llama / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]  # one shard of the fused qkv
    del tensors["model.norm.weight"]
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt", tensors)
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.1\.self_attn\.k_proj"
                       r"\.weight, model\.norm\.weight") as e:
        load(path)
    assert str(path) in str(e.value)


def test_unexpected_tensor(tiny_llama: Path, tmp_path: Path) -> None:
    tensors = load_file(str(tiny_llama / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # ignored
    tensors["model.layers.0.mlp.extra.weight"] = torch.ones(2)
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt", tensors)
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.mlp\.extra"):
        load(path)


def test_shape_mismatch(tiny_llama: Path, tmp_path: Path) -> None:
    tensors = load_file(str(tiny_llama / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.ones(127, 64)
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt", tensors)
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has shape "
        r"\[127, 64\], the model expects \[128, 64\]",
    ):
        load(path)


def test_sharded_checkpoint_loads_like_one_file(tiny_llama: Path, tmp_path: Path, runner: ModelRunner) -> None:
    tensors = load_file(str(tiny_llama / "model.safetensors"))
    names = sorted(tensors)
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(path / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = [[5, 6, 7]]
    got = load(path).forward(extend(ids, [torch.arange(1, 4)], [0]))
    torch.testing.assert_close(got, runner.forward(extend(ids, [torch.arange(1, 4)], [0])))

    (path / "model-00002-of-00002.safetensors").rename(path / "elsewhere.safetensors")
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors, which does not exist"):
        load(path)


def test_tensor_in_two_files(tiny_llama: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    shutil.copy(tiny_llama / "model.safetensors", path / "a.safetensors")
    shutil.copy(tiny_llama / "model.safetensors", path / "b.safetensors")
    with pytest.raises(ValueError, match=r"b\.safetensors: tensor '.*' also in .*a\.safetensors"):
        load(path)


def test_no_weights(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load(copy_checkpoint(tiny_llama, tmp_path / "ckpt"))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_matches_cpu(tiny_llama: Path, runner: ModelRunner, backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("sprig.runtime.attention.triton_backend")
    cuda = ModelRunner(RunnerConfig(tiny_llama, device="cuda", attention_backend=backend))
    assert cuda.num_slots > 0 and cuda.kv_cache.k[0].is_cuda
    ids = [[5, 6, 7, 8], [9, 10]]
    step = extend(ids, [torch.arange(1, 5), torch.arange(5, 7)], [0, 0])
    torch.testing.assert_close(cuda.forward(step).cpu(), runner.forward(step), atol=1e-4, rtol=0)
