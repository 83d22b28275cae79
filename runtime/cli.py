"""The `sprig` command line. `sprig serve [--model PATH] [options]` starts the HTTP server
(on sprig's embedded demo model when no model is given).

Every option is a field of `ServerConfig`, `RunnerConfig`, `SchedulerConfig`, `DistConfig`
or `DataParallelConfig`, with that dataclass's default; the dataclasses validate the
values. The configs and the names their options take live in modules that import neither
torch nor transformers, so building the parser (and `--help`) imports neither; what runs a
command is imported inside the functions: spawned children (the gateway's) re-import the
main module, and this one is it when run as the `sprig` script. `sprig serve` starts the
forkserver its scheduler and detokenizer fork from before it parses its flags, so that
both import at once (`sprig.runtime.server.forkserver`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from importlib.metadata import version
from pathlib import Path
from typing import Any, NoReturn

from sprig.runtime.attention import ATTENTION_BACKENDS
from sprig.runtime.distributed.config import DistConfig
from sprig.runtime.engine_config import EngineConfig
from sprig.runtime.quantization.online_schemes import ONLINE_GROUP_SIZES, ONLINE_SCHEMES
from sprig.runtime.runner_config import DTYPES, KV_CACHE_DTYPES, RunnerConfig
from sprig.runtime.scheduler.config import (
    EVICTION_POLICIES,
    GRAMMAR_BACKENDS,
    SCHEDULE_POLICIES,
    SGLANG_NAMES_NOTE,
    SGLANG_SPECULATIVE_ALGORITHMS,
    SPECULATIVE_ALGORITHMS,
    SchedulerConfig,
)
from sprig.runtime.server.config import (
    LOG_LEVELS,
    REASONING_PARSER_ALIASES,
    REASONING_PARSERS,
    TOOL_CALL_PARSER_ALIASES,
    TOOL_CALL_PARSERS,
    ServerConfig,
)
from sprig.runtime.server.dp_config import ROUTER_POLICIES, DataParallelConfig, GatewayConfig

OWN_FLAGS = frozenset({"model_path", "api_keys"})  # config fields whose flags `build_parser` spells out
HELP = {
    "host": "address to listen on",
    "port": "port to listen on; 0 picks a free port (the 'ready at' log line names it)",
    "served_model_name": "model id in /v1/models and OpenAI responses (default: the checkpoint directory's name; sprig-demo for the demo model)",
    "max_request_bytes": "larger request bodies get 413",
    "enable_lora": "serve LoRA adapters (on when --lora-paths names some): requests pick one by name in lora_path, "
                   "or as the OpenAI model 'MODEL:ADAPTER' or 'ADAPTER'",
    "lora_paths": "PEFT LoRA adapters to load at start, each NAME=PATH or PATH (named by itself)",
    "max_loras_per_batch": "adapter slots: how many adapters can be loaded at once (every loaded one can run in any batch)",
    "max_lora_rank": "the largest adapter rank a slot holds (default: the largest of --lora-paths)",
    "lora_target_modules": "the module kinds adapters may adapt: q_proj k_proj v_proj o_proj gate_proj up_proj "
                           "down_proj, or all (default: those --lora-paths adapt)",
    "responses_store_bytes": "memory for stored /v1/responses (previous_response_id, GET /v1/responses/ID), least "
                             "recently used dropped first; 0 stores none",
    "chat_template": "a Jinja chat template file to use instead of the model's",
    "tool_call_parser": "tool-call format of chat answers (auto: the one the chat template writes, Qwen3-Coder's "
                        "XML calls and gpt-oss's harmony included; none: never parse). Without a format, tool_choice auto answers plain "
                        "text; required or a named function still work on any model: the call is then a bare "
                        "JSON object constrained to the tool's schema. SGLang's and vLLM's names work too (qwen25 "
                        "and qwen are hermes, llama3_json is llama3, qwen3_xml is qwen3_coder, openai is gpt-oss). mistral "
                        "reads Mistral's v11 calls ([TOOL_CALLS]NAME[ARGS]{...}) where the chat template writes "
                        "[ARGS], else the older JSON list; mistral_v11 names the v11 format outright",
    "reasoning_parser": "split a reasoning model's <think>...</think> (qwen3, deepseek-r1), Magistral's "
                        "[THINK]...[/THINK] special tokens (mistral) or harmony analysis channel (gpt-oss: its final channel is the answer, its calls are read too) into "
                        "reasoning_content; response_format and forced tool calls then constrain only the answer "
                        "(vLLM's names work too: deepseek_r1, openai_gptoss)",
    "thinking_budget": "the most tokens a reasoning model may think in chat, Responses and Messages requests that "
                       "give no budget of their own; then the server writes </think> ([/THINK] for mistral) "
                       "and the answer follows (needs --reasoning-parser qwen3, deepseek-r1 or mistral)",
    "read_timeout": "seconds a client has to send a request's headers, and again its body (408 / closed after)",
    "watchdog_timeout": "seconds a child process may show no sign of life (a step longer than this counts as stuck) before the server exits non-zero",
    "stats_interval": "seconds between the scheduler's stats reports (feed /metrics)",
    "log_interval": "seconds between activity log lines (only when there is activity)",
    "log_level": "log level of every process",
    "access_log": "log every HTTP request",
    "allowed_local_media_path": "a directory whose image files requests may name by path or file:// URL "
                                "(default: local paths refused)",
    "disable_media_urls": "refuse http(s) image URLs in requests (default: fetched, at most 20 MiB within 10 s)",
    "dtype": "weight and KV dtype (auto: the checkpoint's)",
    "device": "cpu, cuda or cuda:N (auto: cuda if available)",
    "attention_backend": "attention implementation (auto: the device's default)",
    "page_size": "tokens per KV page",
    "max_total_tokens": "KV pool size in tokens (default: from free GPU memory, or the bytes of 16384 float tokens on CPU)",
    "mem_fraction_static": "share of free GPU memory for the KV pool when --max-total-tokens is not given",
    "random_seed": "seed of the sampling RNG for unseeded requests (SGLang's --random-seed)",
    "cpu_threads": "torch threads of the scheduler process (default: one per core on CPU, 1 on CUDA)",
    "disable_cuda_graph": "run every decode step eagerly instead of replaying captured CUDA graphs",
    "cuda_graph_max_bs": "largest decode batch replayed from a CUDA graph; larger batches run eagerly",
    "shadow_attention": "check every layer's attention against the plain reference backend (slow; for debugging)",
    "quantization": "quantize a float checkpoint's linear layers as they load: int8 (per output channel), "
                    "int4 (a scale and a zero point per group of --quantization-group-size inputs) or fp8 "
                    "(e4m3, per output channel); quantized checkpoints (GPTQ, AWQ, compressed-tensors, "
                    "fp8) load as their config says without it",
    "quantization_group_size": "inputs sharing one scale and zero point with --quantization int4",
    "context_length": "longest context (prompt + output) to serve, instead of the checkpoint's max_position_embeddings; "
                      "at most what its rope config covers",
    "kv_cache_dtype": "KV cache storage: auto (the model's dtype), int8, or fp8_e4m3 (CUDA only), quantized "
                      "with a scale per token and KV head; the same memory then holds more tokens",
    "max_running_requests": "most requests decoding at once",
    "max_prefill_tokens": "most new prompt tokens in one prefill step",
    "chunked_prefill_size": "most prompt tokens one request computes per step; 'none' disables chunking",
    "schedule_policy": "order waiting requests are admitted in",
    "disable_radix_cache": "do not reuse cached prefixes",
    "eviction_policy": "which cached prefixes are evicted first",
    "max_queued_requests": "requests waiting beyond this get 503",
    "new_token_ratio": "share of running requests' remaining max_new_tokens reserved before admitting more",
    "min_new_token_ratio": "floor the reserved share decays to",
    "new_token_ratio_decay": "decay of the reserved share per decode step",
    "in_batch_prefix_min": "shared uncached prefix length that defers a request by a step",
    "check_integrity": "check the KV accounting after every step (slow; for debugging)",
    "enable_priority_scheduling": "admit waiting requests by their `priority` first (requests may carry one "
    "only then), preempting running requests it outranks by more than the threshold",
    "schedule_low_priority_values_first": "under priority scheduling, lower priority values go first (the default: "
    "higher ones, as SGLang's)",
    "priority_scheduling_preemption_threshold": "how much a waiting request's priority must exceed a running "
    "one's for it to be retracted in its favour",
    "weight_version": "a label for the weights loaded at start, in every response's meta_info until "
    "/update_weights_from_disk or /update_weight_version names another",
    "grammar_compile_timeout_s": "seconds a regex, JSON schema or ebnf grammar may take to compile; longer is a 400",
    "speculative_algorithm": "speculative decoding's drafter (off by default): ngram (prompt lookup in the "
    "request's own context), radix (the radix cache's most visited continuation: sibling samples, earlier "
    "branches; less visited branches verified beside it as a token tree) or draft (a draft model's greedy continuation, --speculative-draft-model-path; SGLang's "
    "NGRAM and STANDALONE name ngram and draft); outputs are exactly those without it",
    "speculative_draft_model_path": "the draft model of --speculative-algorithm draft: a local Hugging Face "
    "checkpoint with the target's tokenizer (same vocabulary, same token ids), run beside the target with a KV "
    "pool of as many slots (with --tp-size > 1: whole, beside rank 0)",
    "disable_draft_decoder": "run the draft model's decode steps through its model runner on the CPU too, "
    "instead of the contiguous CPU draft decoder (the plain path; for checking it)",
    "speculative_num_draft_tokens": "most drafted tokens verified per request and step (each request's length "
    "adapts to its acceptance)",
    "speculative_alternatives": "most other paths a request verifies beside its draft in a step (a token tree: "
    "radix's less visited branches, ngram's earlier matches; each only where it is expected to pay; page size 1); "
    "0: drafts only",
    "speculative_pass_costs": "milliseconds of a target decode pass, a verification pass and a draft-model step "
    "as seven numbers (decode fixed, per request; verify fixed, per request, per token; draft fixed, per request), which decide "
    "how many drafts a step verifies, none unless drafting is expected to be faster; when not given, measured at "
    "startup, logged, and corrected by timing the passes as they run (given ones are used as they are, so a run's "
    "choices replay exactly; 1,0,0,0,0,0,0 drafts whenever the drafter proposes)",
    "grammar_backend": "what compiles regex / json_schema / response_format constraints: outlines (slow to compile, "
                       "cheap per token) or llguidance (compiles in milliseconds, costlier per token); "
                       "ebnf grammars and JSON schemas with free-form JSON (json_object, an object with no "
                       "properties, an array with no items, a {} value) always use llguidance",
    "dp_size": "data parallelism: start this many workers (each a full server on 127.0.0.1) behind SGLang's "
               "Model Gateway, which listens on --host/--port (needs: pip install 'sprig[gateway]')",
    "tp_size": "tensor parallelism: split the model over this many ranks, one process each (one GPU each on "
               "CUDA, over NCCL; gloo on CPU)",
    "nnodes": "nodes the --tp-size ranks are spread over (each runs tp_size / nnodes of them)",
    "node_rank": "this node's index; node 0 runs the server, the others only their ranks",
    "dist_init_addr": "host:port where node 0's rank 0 meets the other ranks (needed with --nnodes > 1; "
                      "default: a free port of 127.0.0.1)",
    "dist_timeout": "seconds a collective inside a step may take before the server counts a rank failed and "
                    "exits (idle ranks wait for the next step without a limit)",
    "router_policy": "how the gateway picks a worker; cache_aware: the one whose cache most likely holds the "
                     "prompt's prefix, unless it is far busier than the others",
}


SECTIONS: tuple[tuple[str, type], ...] = (
    ("server", ServerConfig), ("model runner", RunnerConfig), ("scheduler", SchedulerConfig),
    ("tensor parallelism", DistConfig), ("data parallelism", DataParallelConfig),
)
CHOICES: dict[str, tuple[Any, ...]] = {
    "dtype": ("auto", *DTYPES),
    "attention_backend": ("auto", *ATTENTION_BACKENDS),
    "quantization": ONLINE_SCHEMES,
    "quantization_group_size": ONLINE_GROUP_SIZES,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "schedule_policy": SCHEDULE_POLICIES,
    "grammar_backend": GRAMMAR_BACKENDS,
    "speculative_algorithm": SPECULATIVE_ALGORITHMS,
    "eviction_policy": EVICTION_POLICIES,
    "log_level": LOG_LEVELS,
    "tool_call_parser": (*TOOL_CALL_PARSERS, *TOOL_CALL_PARSER_ALIASES),
    "reasoning_parser": (*REASONING_PARSERS, *REASONING_PARSER_ALIASES),
    "router_policy": ROUTER_POLICIES,
}


def _optional(kind: type) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = kind.__name__
    return parse


def _speculative_algorithm(text: str) -> str:
    """`--speculative-algorithm`: a drafter's name in any case, SGLang's names of the same
    drafters (NGRAM, STANDALONE) included. SGLang's other speculative flags are not taken
    (`--speculative-num-steps`, `--speculative-eagle-topk`), and its
    `--speculative-num-draft-tokens` counts the tokens a step verifies per request, the
    last kept one included, where sprig's bounds the drafts alone."""
    name = SGLANG_SPECULATIVE_ALGORITHMS.get(text.upper(), text.lower())
    if name not in SPECULATIVE_ALGORITHMS:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(SPECULATIVE_ALGORITHMS)}; {SGLANG_NAMES_NOTE})")
    return name


PARSERS: dict[str, Any] = {"speculative_algorithm": _speculative_algorithm}  # fields whose flags read more than their type


def _add_fields(group: argparse._ArgumentGroup, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in OWN_FLAGS:
            continue
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else [hint]
        kind, optional = args[0], hint is not args[0]
        flag = "--" + f.name.replace("_", "-")
        help_text = HELP.get(f.name, f"see {cls.__name__}")
        if kind is bool:
            action = group.add_argument(flag, dest=f.name, default=f.default, help=help_text,
                                        action=argparse.BooleanOptionalAction)
        elif typing.get_origin(kind) is tuple:  # a list of values: the flag takes one or more
            action = group.add_argument(flag, dest=f.name, default=f.default, help=help_text, nargs="+",
                                        type=str, metavar=f.name.upper().removesuffix("S"))
        else:
            action = group.add_argument(flag, dest=f.name, default=f.default, help=help_text,
                                        type=PARSERS.get(f.name) or (_optional(kind) if optional else kind),
                                        choices=CHOICES.get(f.name),
                                        metavar=None if f.name in CHOICES else f.name.upper())
        if "default" not in (action.help or ""):
            action.help = f"{action.help} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sprig", description="sprig: structured generation runtime for LLMs")
    parser.add_argument("-v", "--version", action="version", version=version("sprig"))
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")  # none: print this help
    serve = commands.add_parser(
        "serve",
        help="start the HTTP server (SGLang /generate and OpenAI-compatible routes)",
        description="Start the HTTP server: an HTTP process, a scheduler process and a detokenizer "
        "process. SIGINT or SIGTERM stops all three.",
    )
    serve.add_argument("--model", "--model-path", dest="model_path", default=None, metavar="PATH",
                       help="a local Hugging Face checkpoint directory (weights, config, tokenizer); "
                       "default: sprig's embedded demo model")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health and /metrics "
                       "(visible to other users in `ps`: prefer SPRIG_API_KEY or --api-key-file)")
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="read the API keys from this file, one per line, instead of --api-key; each key is "
                       "a client of its own (/abort_request aborts only requests sent with the same key)")
    for title, cls in SECTIONS:
        _add_fields(serve.add_argument_group(f"{title} options"), cls)
    _add_router(commands)
    return parser


def _add_router(commands: argparse._SubParsersAction) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(GatewayConfig)}
    router = commands.add_parser(
        "router",
        help="start SGLang's Model Gateway in front of running sprig servers (data parallelism across machines)",
        description="Start SGLang's Model Gateway (pip install 'sprig[gateway]') in front of sprig servers "
        "started elsewhere ('sprig serve --host 0.0.0.0' on each machine). It logs 'ready at URL' once it "
        "routes to every worker; SIGINT or SIGTERM stops it. The API key (--api-key-file, SPRIG_API_KEY or "
        "--api-key) is checked on clients and sent to the workers.",
    )
    router.add_argument("--worker-urls", nargs="+", required=True, metavar="URL", help="the servers, http://host:port")
    router.add_argument("--host", default=defaults["host"], help=f"{HELP['host']} (default: %(default)s)")
    router.add_argument("--port", type=int, default=defaults["port"], help=f"{HELP['port']} (default: %(default)s)")
    router.add_argument("--policy", choices=ROUTER_POLICIES, default=defaults["policy"],
                        help=f"{HELP['router_policy']} (default: %(default)s)")
    router.add_argument("--health-check-interval", type=int, default=defaults["health_check_interval"],
                        metavar="SECONDS", help="seconds between health probes of each worker; two failed probes in "
                        "a row take it out of rotation (default: %(default)s)")
    router.add_argument("--api-key", default=None, metavar="KEY", help="visible to other users in `ps`")
    router.add_argument("--api-key-file", default=None, metavar="PATH", help="a file holding the API key")
    router.add_argument("--log-level", choices=LOG_LEVELS, default=defaults["log_level"])
    router.add_argument("gateway_args", nargs=argparse.REMAINDER, metavar="-- GATEWAY_ARGS",
                        help="more flags for the gateway, as `smg launch --help` lists them (e.g. -- --cache-threshold 0.5)")


def _router(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from sprig.runtime.server import gateway

    if not gateway.gateway_installed():
        parser.error(gateway.INSTALL_HINT)
    try:
        keys = _api_keys(args)
        if len(keys) > 1:
            raise ValueError("the gateway checks one API key; --api-key-file holds several")
        extra = args.gateway_args[1:] if args.gateway_args[:1] == ["--"] else args.gateway_args
        config = GatewayConfig(tuple(args.worker_urls), args.host, args.port, args.policy,
                                       args.health_check_interval, keys[0] if keys else None, args.log_level,
                                       tuple(extra))
    except OSError as e:
        parser.error(f"--api-key-file: {e}")
    except ValueError as e:
        parser.error(str(e))
    try:
        gateway.serve_gateway(config)
    except RuntimeError as e:
        print(f"sprig: error: {e}", file=sys.stderr)
        return 1
    return 0


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key-file's lines (blank ones skipped), else --api-key, else the SPRIG_API_KEY
    environment variable; `OSError` if the file cannot be read, `ValueError` if it holds no key."""
    if args.api_key_file is not None:
        keys = tuple(line.strip() for line in Path(args.api_key_file).read_text().splitlines() if line.strip())
        if not keys:
            raise ValueError(f"--api-key-file {args.api_key_file!r} holds no key")
        return keys
    key = args.api_key if args.api_key is not None else os.environ.get("SPRIG_API_KEY")
    return () if key is None else (key,)


def configs_from_args(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    """The configs the parsed flags describe; `ValueError`/`TypeError` if they are invalid."""
    def pick(cls: type) -> dict[str, Any]:
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name not in OWN_FLAGS}

    server = ServerConfig(**pick(ServerConfig), api_keys=_api_keys(args))
    engine = EngineConfig.from_kwargs(args.model_path, **pick(RunnerConfig), **pick(SchedulerConfig),
                                      **pick(DistConfig))
    return server, engine


def _serves_here(argv: list[str]) -> bool:
    """Whether `argv` starts a server in this process (not only help, not one server per
    data-parallel worker, not another node's tensor-parallel ranks)."""
    others = {"-h", "--help", "--dp-size", "--node-rank"}
    return argv[:1] == ["serve"] and not any(arg.split("=")[0] in others for arg in argv)


def main(argv: list[str] | None = None) -> int:
    if _serves_here(sys.argv[1:] if argv is None else argv):
        from sprig.runtime.server.forkserver import start_forkserver

        start_forkserver()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "router":
        return _router(parser, args)
    if args.model_path is None:
        from sprig.runtime.demo import ensure_demo_model

        args.model_path = str(ensure_demo_model())
    if not Path(args.model_path).is_dir():
        parser.error(f"--model {args.model_path!r} is not a directory")
    from sprig.runtime.server.dp import launch_data_parallel
    from sprig.runtime.server.gateway import INSTALL_HINT, gateway_installed

    try:
        server, engine = configs_from_args(args)
        dp = DataParallelConfig(args.dp_size, args.router_policy)
    except OSError as e:
        parser.error(f"--api-key-file: {e}")
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    if dp.dp_size > 1 and not gateway_installed():
        parser.error(f"--dp-size: {INSTALL_HINT}")
    if dp.dp_size > 1 and len(server.api_keys) > 1:
        parser.error("--dp-size takes one API key: the gateway checks one")
    from sprig.runtime.server.launch import launch_server

    try:
        if engine.dist.node_rank > 0:  # no server here: this node's tensor-parallel ranks only
            from sprig.runtime.distributed.node import serve_node

            serve_node(engine.runner, engine.dist, server.log_level)
        elif dp.dp_size > 1:
            launch_data_parallel(args.model_path, server, engine, dp)
        else:
            launch_server(args.model_path, server, engine)
    except SystemExit as stop:  # SIGINT or SIGTERM, once everything it started has stopped
        return stop.code if isinstance(stop.code, int) else 1
    except (RuntimeError, ValueError, OSError) as e:  # startup failures; details are in the log
        print(f"sprig: error: {e}", file=sys.stderr)
        return 1
    return 0


def entry() -> NoReturn:
    """The `sprig` command and `python -m sprig.runtime`: `main`, then `processes.exit_now`.
    By then everything a command started has stopped and been joined, and the rest of the
    interpreter's teardown would spend seconds freeing torch's C++ registries (4.4 s after
    a server stopped, on 2 cores). `main` itself returns, for callers that go on running."""
    from sprig.runtime.processes import exit_now

    exit_now(main())
