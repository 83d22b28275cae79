"""The draft-model drafter: its KV lives in a second pool at the target's slots, written
lazily where a per-slot flag says it is missing (so a target that is its own draft has
every draft accepted, through cache hits, chunked prefill and retraction); drafts of
another shape leave greedy outputs exact; bad flags are refused naming the flag. Both
round implementations run these: the CPU's contiguous `DraftDecoder` and the runner's
own decode steps (`RunnerRounds`, what CUDA runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from draft_checkpoints import copy_tokenizer, truncated_draft
from engine_helpers import assert_idle_and_intact, hf_greedy

from sprig.runtime import Engine
from sprig.runtime.cli import main
from sprig.runtime.model_runner import draft_footprint
from sprig.runtime.speculative import draft_model
from sprig.runtime.speculative.draft_decoder import supports as decoder_supports
from sprig.runtime.speculative.draft_model import DraftModel
from sprig.runtime.speculative.runner_rounds import RunnerRounds
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

PROMPTS = [
    "the cat the cat the cat the cat",
    "one two three one two three one",
    "a quick fox",
    "how the model caches the prefix tree of the request",
]
MAX_NEW = 20
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
PATH_FLAG = "--speculative-draft-model-path"
SELF_DRAFT_ACCEPTANCE = 0.97  # a self-draft's drafts differ from the target's tokens only on near-ties


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another model of other shapes (1 layer, hidden 32, head_dim 16, one KV head) with the
    tiny llama's tokenizer (the same seed trains the same one)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("draft") / "small", "llama", hidden_size=32,
                                 intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1)


@pytest.fixture(params=["decoder", "runner"])
def rounds(request: pytest.FixtureRequest) -> str:
    """Which rounds the draft runs: `DraftDecoder` (the CPU's own) or `RunnerRounds`
    (`disable_draft_decoder`)."""
    return request.param


def _engine(target: Path, draft: Path, rounds: str = "decoder", **options) -> Engine:
    return Engine(target, dtype="float32", check_integrity=True, speculative_algorithm="draft",
                  speculative_draft_model_path=str(draft), speculative_pass_costs="1,0,0,0,0,0,0",
                  disable_draft_decoder=rounds == "runner", **options)


def _run_twice(engine: Engine, prompts: list[str] = PROMPTS, max_new: int = MAX_NEW, runs: int = 2) -> list[list[int]]:
    """The prompts cold, then again with their prefixes (and outputs) cached (`runs=1`: cold only)."""
    outs = []
    for _ in range(runs):
        outs += [o["output_ids"] for o in engine.generate(prompts, {**GREEDY, "max_new_tokens": max_new})]
        assert_idle_and_intact(engine)
    return outs


def _twice_under(options: dict, engine: Engine, reference: list[list[int]],
                 triton_runs: int = 2) -> tuple[list[list[int]], list[list[int]]]:
    """`_run_twice`'s outputs and the reference they must equal: under interpreted Triton
    (slow on the CPU) two prompts, half as long (greedy ignoring EOS: a prefix of the
    reference), `triton_runs` times."""
    if options.get("attention_backend") != "triton":
        return _run_twice(engine), reference * 2
    new = MAX_NEW // 2
    return _run_twice(engine, PROMPTS[:2], new, triton_runs), [ref[:new] for ref in reference[:2]] * triton_runs


OPTIONS = [
    {},
    {"chunked_prefill_size": 3, "page_size": 4},
    {"max_total_tokens": 96, "new_token_ratio": 0.0, "min_new_token_ratio": 0.0, "max_running_requests": 4},
    {"attention_backend": "triton", "page_size": 4},
]
OPTION_IDS = ["plain", "chunked-paged", "retraction", "triton"]
# Each of the rounds under each option, but Triton attention only with the runner's rounds
# (what CUDA runs): `DraftDecoder` attends in torch whatever the backend, so its Triton
# case would repeat the runner's Triton passes (interpreted, the slowest here) and its own
# plain case.
ROUNDS_OPTIONS = [
    pytest.param(rounds, options, id=f"{rounds}-{name}")
    for rounds in ("decoder", "runner")
    for options, name in zip(OPTIONS, OPTION_IDS, strict=True)
    if rounds == "runner" or "attention_backend" not in options
]


@pytest.mark.parametrize(("rounds", "options"), ROUNDS_OPTIONS)
def test_a_self_draft_has_every_draft_accepted(options, rounds, tiny_llama, reference) -> None:
    """The target as its own draft: its drafts are the target's greedy tokens exactly when
    the draft pool holds the target's K/V at every slot the drafts read, prefixes cached
    by other requests, other chunks and retracted requests' slots included. (On CUDA
    `DraftDecoder` does not run: both cases run the runner's rounds there.)"""
    with _engine(tiny_llama, tiny_llama, rounds, **options) as engine:
        drafter = engine.scheduler.speculative.drafter
        assert isinstance(drafter.rounds, RunnerRounds) == (rounds == "runner" or not decoder_supports(drafter.runner))
        got, want = _twice_under(options, engine, reference)
        assert got == want
        stats = engine.scheduler.speculative.stats
        if "max_total_tokens" in options:
            assert engine.scheduler.stats.retractions > 0
    assert stats.drafted > 0 and stats.acceptance_rate > SELF_DRAFT_ACCEPTANCE


@pytest.mark.parametrize("skipped", ["mirror", "verified"])
def test_a_stale_written_flag_is_caught(skipped, rounds, tiny_llama, monkeypatch) -> None:
    """Without the prefills' or the verification passes' clearing of `written`, slots the
    target rewrote (freed and handed to other tokens in a small pool, or a rejected
    draft's slot reused for the target's own token) still count as holding the draft's
    K/V: the shadow check of `check_integrity` (`DraftModel.check`) finds such a slot.
    The same run with the clearing passes it (the other tests here)."""
    monkeypatch.setattr(DraftModel, skipped, lambda self, *args: None)
    engine = _engine(tiny_llama, truncated_draft(tiny_llama), rounds, **OPTIONS[2])
    with engine, pytest.raises(AssertionError, match="draft KV: slot"):
        _run_twice(engine)


@pytest.mark.parametrize(("rounds", "options"), ROUNDS_OPTIONS)
def test_a_draft_of_other_shapes_keeps_greedy_exact(options, rounds, tiny_llama, small_draft, reference) -> None:
    """Under Triton cold only: the self-draft's Triton case runs the runner's rounds over
    cached prefixes, and this one's other cases cached prefixes of a pool of other shapes."""
    with _engine(tiny_llama, small_draft, rounds, **options) as engine:
        assert engine.scheduler.speculative.drafter.runner.kv_cache.shape.num_layers == 1
        got, want = _twice_under(options, engine, reference, triton_runs=1)
        assert got == want
        assert engine.scheduler.speculative.stats.drafted > 0


def test_n_samples_stop_strings_and_logprobs_equal_plain(tiny_llama) -> None:
    sp = {"max_new_tokens": MAX_NEW, "temperature": 0.8, "sampling_seed": 7, "n": 3, "stop": [" the", "ca"]}
    with Engine(tiny_llama, dtype="float32") as plain:
        want = plain.generate(PROMPTS, sp, return_logprob=True, top_logprobs_num=2)
    with _engine(tiny_llama, truncated_draft(tiny_llama)) as engine:
        got = engine.generate(PROMPTS, sp, return_logprob=True, top_logprobs_num=2)
        assert_idle_and_intact(engine)
        assert engine.scheduler.speculative.stats.accepted > 0
    for g, w in zip(got, want, strict=True):
        assert (g["output_ids"], g["text"]) == (w["output_ids"], w["text"])
        assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
        got_lp, want_lp = g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"]
        assert [lp for lp, _, _ in got_lp] == pytest.approx([lp for lp, _, _ in want_lp], abs=1e-5)


def test_under_tensor_parallelism_the_draft_runs_whole_beside_rank_0(tiny_llama, reference) -> None:
    """TP = 2 over gloo: each rank holds one of the target's two KV heads, the draft (the
    target itself) both, at the same slots; greedy outputs equal transformers' with nearly
    every draft kept, and seeded samples equal plain decoding's on one rank."""
    sp = {"max_new_tokens": MAX_NEW, "temperature": 0.8, "sampling_seed": 7, "n": 2}
    with Engine(tiny_llama, dtype="float32") as plain:
        want = [o["output_ids"] for o in plain.generate(PROMPTS, sp)]
    with _engine(tiny_llama, tiny_llama, tp_size=2, device="cpu", cpu_threads=1) as engine:
        drafter = engine.scheduler.speculative.drafter
        assert engine.runner.kv_cache.shape.num_kv_heads == 1
        assert drafter.runner.kv_cache.shape.num_kv_heads == 2
        assert drafter.runner.num_slots == engine.runner.num_slots
        assert _run_twice(engine) == reference * 2
        assert engine.scheduler.speculative.stats.acceptance_rate > SELF_DRAFT_ACCEPTANCE
        assert [o["output_ids"] for o in engine.generate(PROMPTS, sp)] == want
        assert_idle_and_intact(engine)


def test_samples_sharing_a_prefix_the_draft_has_not_written(rounds, tiny_llama) -> None:
    """A prompt past the CPU attention's shared-prefix threshold (32 tokens) is cached by a
    request that never drafted (one token, from the prefill), then n samples of it share
    its slots, which the draft has not written: one pass may not write them twice (the
    CPU attention refuses it), so one sample feeds them and the others follow. Outputs
    equal plain decoding's, and the self-draft's drafts are kept (the shared K/V it wrote
    once serves all four)."""
    prompt = " ".join(["the cat sat on the mat"] * 8)
    sp = {"max_new_tokens": 12, "temperature": 0, "n": 4, "ignore_eos": True}
    with Engine(tiny_llama, dtype="float32") as plain:
        want = [o["output_ids"] for o in plain.generate([prompt], sp)]
    with _engine(tiny_llama, tiny_llama, rounds) as engine:
        engine.generate([prompt], {"max_new_tokens": 1})
        assert engine.scheduler.speculative.stats.drafted == 0
        assert [o["output_ids"] for o in engine.generate([prompt], sp)] == want
        assert_idle_and_intact(engine)
        assert engine.scheduler.speculative.stats.acceptance_rate > SELF_DRAFT_ACCEPTANCE


CONSTRAINED = [  # greedy, under a regex the tiny model would leave, a schema, and a regex behind a reasoning gate
    {"max_new_tokens": 16, "temperature": 0, "regex": "(ab|cd)+x"},
    {"max_new_tokens": 16, "temperature": 0, "json_schema": {
        "type": "object", "properties": {"word": {"enum": ["the cat", "the dog"]}}, "required": ["word"]}},
    {"max_new_tokens": 16, "temperature": 0, "regex": "(ab)+", "reasoning_end": "e", "thinking_budget": 4},
]


@pytest.mark.parametrize("walked", [True, False], ids=["walked", "unwalked"])
def test_a_self_draft_drafts_under_the_grammar(walked, rounds, tiny_llama, monkeypatch) -> None:
    """The draft proposes under each constrained request's grammar (`GrammarWalk`): a
    self-draft's drafts are then the target's masked greedy tokens, every one kept, and
    outputs equal plain decoding's. Unwalked, the same self-draft proposes its unmasked
    argmax, which the grammar refuses where it bites (the draft is cut there), and keeps
    far fewer."""
    if not walked:
        monkeypatch.setattr(draft_model, "GrammarWalk", lambda grammars: None)
    prompts = PROMPTS[:2] * len(CONSTRAINED)
    params = [p for p in CONSTRAINED for _ in range(2)]
    with Engine(tiny_llama, dtype="float32") as plain:
        want = [o["output_ids"] for o in plain.generate(prompts, params)]
    with _engine(tiny_llama, tiny_llama, rounds) as engine:
        assert [o["output_ids"] for o in engine.generate(prompts, params)] == want
        assert_idle_and_intact(engine)
        stats = engine.scheduler.speculative.stats
    assert stats.drafted > 0 and stats.acceptance_rate > SELF_DRAFT_ACCEPTANCE  # refused drafts are cut unverified
    assert (stats.mean_accept_length > 1.5) == walked  # walked: 1.68 tokens per pass here; unwalked: 1.08


# ---------------------------------------------------------------- refused configurations


def test_the_flags_go_together(tiny_llama) -> None:
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        Engine(tiny_llama, speculative_algorithm="draft")
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        Engine(tiny_llama, speculative_algorithm="ngram", speculative_draft_model_path=str(tiny_llama))


def test_a_draft_that_cannot_serve_is_refused(tiny_llama, tmp_path) -> None:
    """Another vocabulary or tokenizer, no tokenizer, a shorter context, no checkpoint."""
    other_size = build_tiny_checkpoint(tmp_path / "size", "llama", vocab_size=400)
    other_ids = build_tiny_checkpoint(tmp_path / "ids", "llama", seed=1)
    short = build_tiny_checkpoint(tmp_path / "short", "llama", max_position_embeddings=64)
    no_tokenizer = tmp_path / "bare"
    truncated_draft(tiny_llama)  # written beside the target, with its tokenizer
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((truncated_draft(tiny_llama) / name).read_bytes())
    for draft, message in [(other_size, "vocabulary has"), (other_ids, "other ids"),
                           (no_tokenizer, "cannot load a tokenizer"), (short, "context_length 1024 exceeds"),
                           (tmp_path / "missing", "not a directory")]:
        with pytest.raises(ValueError, match=message) as e:
            Engine(tiny_llama, dtype="float32", speculative_algorithm="draft", speculative_draft_model_path=str(draft))
        assert PATH_FLAG in str(e.value)
    copy_tokenizer(tiny_llama, no_tokenizer)  # with the target's tokenizer it is a valid draft
    with _engine(tiny_llama, no_tokenizer) as engine:
        assert [o["output_ids"] for o in engine.generate(PROMPTS[:1], GREEDY)] == hf_greedy(tiny_llama, PROMPTS[:1], MAX_NEW)


def test_the_cli_refuses_a_draft_algorithm_without_a_model(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", str(tmp_path), "--speculative-algorithm", "draft"])
    assert exc.value.code == 2 and PATH_FLAG in capsys.readouterr().err


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_draft_footprint_is_what_the_draft_runner_takes(kv_cache_dtype, tiny_llama, small_draft) -> None:
    """What a CUDA target's pool leaves room for (the draft's weights in the target's dtype,
    its KV bytes per token in the target's storage) is what the draft's runner allocates."""
    with Engine(tiny_llama, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, speculative_algorithm="draft",
                speculative_draft_model_path=str(small_draft)) as engine:
        target = engine.runner
        draft = engine.scheduler.speculative.drafter.runner
        weights = sum(t.numel() * t.element_size() for t in draft.model.state_dict().values())
        assert draft_footprint(str(small_draft), target.kv_cache.shape, target.model_config.context_len) == (
            weights, draft.kv_cache.shape.bytes_per_token)
        assert draft.kv_cache.shape.storage == target.kv_cache.shape.storage


@pytest.mark.gpu
def test_on_cuda_a_default_pool_leaves_room_for_the_draft(tiny_llama, small_draft, reference) -> None:
    """Sized by --mem-fraction-static (no --max-total-tokens), the target's pool, the
    draft's weights and the draft's pool of the same slots all fit in that fraction."""
    import torch

    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    with Engine(tiny_llama, device="cuda", dtype="float32", speculative_algorithm="draft",
                speculative_draft_model_path=str(small_draft), mem_fraction_static=0.5) as engine:
        target, draft = engine.runner, engine.scheduler.speculative.drafter.runner
        assert draft.num_slots == target.num_slots > 0
        pools = target.num_slots * (target.kv_cache.shape.bytes_per_token + draft.kv_cache.shape.bytes_per_token)
        assert 0.4 * free_before < pools < 0.5 * free_before
        assert [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)] == reference


@pytest.mark.gpu
def test_on_cuda_the_draft_decodes_in_cuda_graphs(tiny_llama, reference) -> None:
    """The draft's decode steps (drafting, and the kept tokens' catch-up) replay captured
    graphs as the target's do; the self-draft still has every draft accepted."""
    with Engine(tiny_llama, device="cuda", dtype="float32", attention_backend="triton", check_integrity=True,
                speculative_algorithm="draft", speculative_draft_model_path=str(tiny_llama),
                speculative_pass_costs="1,0,0,0,0,0,0") as engine:
        assert _run_twice(engine) == reference * 2
        draft = engine.scheduler.speculative.drafter.runner
        assert draft.graphs is not None and draft.graphs.captured
        assert engine.scheduler.speculative.stats.acceptance_rate > SELF_DRAFT_ACCEPTANCE


def test_the_shipped_draft_serves_the_demo_model() -> None:
    """runtime/demo/draft shares the demo model's tokenizer and predicts it well (a demo
    model trained again with another tokenizer needs `scripts/train_draft_model.py` run again)."""
    from sprig.runtime.demo import DEMO_MODEL_PATH
    from sprig.runtime.demo.evaluate import prompts
    from sprig.runtime.demo.tasks import take

    params = {"max_new_tokens": 64, "temperature": 0}
    with Engine(DEMO_MODEL_PATH, dtype="float32") as plain:
        texts = prompts(plain.tokenizer, take("heldout", 4, seed=0))
        want = [o["output_ids"] for o in plain.generate(texts, params)]
    with _engine(DEMO_MODEL_PATH, DEMO_MODEL_PATH.parent / "draft") as engine:
        assert [o["output_ids"] for o in engine.generate(texts, params)] == want
        assert engine.scheduler.speculative.stats.acceptance_rate > 0.4
