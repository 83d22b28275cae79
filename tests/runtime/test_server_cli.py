"""`sprig serve` flags: one per config field, defaults from the dataclasses, values
validated by them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from sprig.runtime.cli import OWN_FLAGS, _serves_here, build_parser, configs_from_args, main
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.scheduler.config import SchedulerConfig
from sprig.runtime.server.config import ServerConfig


def parse(*flags: str):
    return configs_from_args(build_parser().parse_args(["serve", "--model", "/m", *flags]))


def test_defaults_come_from_the_dataclasses() -> None:
    server, engine = parse()
    assert server == ServerConfig()
    assert engine.runner == RunnerConfig(model_path="/m")
    assert engine.scheduler == SchedulerConfig()


def test_every_field_has_a_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = capsys.readouterr().out
    for cls in (ServerConfig, RunnerConfig, SchedulerConfig):
        for f in dataclasses.fields(cls):
            if f.name not in OWN_FLAGS:
                assert "--" + f.name.replace("_", "-") in help_text, f.name
    assert "--model PATH" in help_text and "--api-key KEY" in help_text and "--api-key-file PATH" in help_text


def test_flags_reach_their_configs() -> None:
    server, engine = parse(
        "--port", "0", "--api-key", "k", "--dtype", "float32", "--max-total-tokens", "512",
        "--chunked-prefill-size", "none", "--disable-radix-cache", "--schedule-policy", "lpm",
        "--max-queued-requests", "3", "--cpu-threads", "1",
    )
    assert (server.port, server.api_keys) == (0, ("k",))
    assert (engine.runner.dtype, engine.runner.max_total_tokens, engine.runner.cpu_threads) == ("float32", 512, 1)
    s = engine.scheduler
    assert (s.chunked_prefill_size, s.disable_radix_cache, s.schedule_policy, s.max_queued_requests) == (
        None, True, "lpm", 3,
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "port must be in"),
        (["--schedule-policy", "random"], "invalid choice"),
        (["--max-running-requests", "0"], "max_running_requests"),
        (["--page-size", "two"], "invalid int value"),
        (["--speculative-algorithm", "EAGLE3"], "EAGLE, EAGLE3 and NEXTN draft with heads"),
        (["--speculative-algorithm", "lookahead"], "choose from ngram, radix, draft"),
        (["--thinking-budget", "64"], "needs a reasoning_parser of think markers (qwen3, deepseek-r1, mistral)"),
        (["--thinking-budget", "64", "--reasoning-parser", "gpt-oss"], "needs a reasoning_parser of think markers"),
        (["--thinking-budget", "-1", "--reasoning-parser", "qwen3"], "thinking_budget must be >= 0"),
    ],
)
def test_invalid_flags_exit_with_a_message(tmp_path, capsys, flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", str(tmp_path), *flags])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("name", "drafter"), [
    ("ngram", "ngram"), ("NGRAM", "ngram"), ("Radix", "radix"), ("draft", "draft"), ("STANDALONE", "draft"),
])
def test_drafters_take_sglangs_names_too(name: str, drafter: str) -> None:
    draft_path = ["--speculative-draft-model-path", "/d"] if drafter == "draft" else []
    _, engine = parse("--speculative-algorithm", name, *draft_path)
    assert engine.scheduler.speculative_algorithm == drafter


@pytest.mark.parametrize(("flags", "tools", "reasoning"), [
    (["--tool-call-parser", "qwen25"], "hermes", None), (["--tool-call-parser", "qwen"], "hermes", None),
    (["--tool-call-parser", "llama3_json"], "llama3", None), (["--tool-call-parser", "qwen3_xml"], "qwen3_coder", None),
    (["--tool-call-parser", "openai", "--reasoning-parser", "openai_gptoss"], "gpt-oss", "gpt-oss"),
    (["--reasoning-parser", "deepseek_r1"], "auto", "deepseek-r1"), (["--reasoning-parser", "gpt_oss"], "auto", "gpt-oss"),
])
def test_parsers_take_sglangs_and_vllms_names_too(flags: list[str], tools: str, reasoning: str | None) -> None:
    server, _ = parse(*flags)
    assert (server.tool_call_parser, server.reasoning_parser) == (tools, reasoning)


def test_a_drafter_sglang_has_and_sprig_has_not_is_named_in_the_configs_error() -> None:
    with pytest.raises(ValueError, match="STANDALONE is draft"):
        SchedulerConfig(speculative_algorithm="EAGLE")


def test_the_api_keys_come_from_a_file_or_the_environment(tmp_path, monkeypatch) -> None:
    from sprig.runtime.cli import _api_keys

    key_file = tmp_path / "key"
    key_file.write_text("from-file\n\n second \n")
    args = build_parser().parse_args(["serve", "--api-key-file", str(key_file), "--api-key", "flag"])
    assert _api_keys(args) == ("from-file", "second")
    monkeypatch.setenv("SPRIG_API_KEY", "from-env")
    assert _api_keys(build_parser().parse_args(["serve"])) == ("from-env",)
    assert _api_keys(build_parser().parse_args(["serve", "--api-key", "flag"])) == ("flag",)
    monkeypatch.delenv("SPRIG_API_KEY")
    assert _api_keys(build_parser().parse_args(["serve"])) == ()
    key_file.write_text("\n \n")
    with pytest.raises(ValueError, match="holds no key"):
        _api_keys(build_parser().parse_args(["serve", "--api-key-file", str(key_file)]))


def test_missing_model_directory(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--model", "/nonexistent/model"])
    assert "is not a directory" in capsys.readouterr().err


def test_module_entry_point_prints_help() -> None:
    out = subprocess.run([sys.executable, "-m", "sprig.runtime", "serve", "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "scheduler options" in out and "--api-key" in out


@pytest.mark.parametrize(("argv", "serves"), [
    (["serve", "--model", "/m"], True),
    (["serve"], True),
    (["serve", "--help"], False),
    (["serve", "-h"], False),
    (["serve", "--dp-size", "2"], False),
    (["serve", "--dp-size=2"], False),
    (["serve", "--node-rank", "1"], False),
    (["router", "--worker-urls", "http://a:1"], False),
    ([], False),
])
def test_the_forkserver_starts_early_only_for_a_server_here(argv: list[str], serves: bool) -> None:
    assert _serves_here(argv) == serves
