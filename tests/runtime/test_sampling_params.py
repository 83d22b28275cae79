"""SamplingParams: SGLang-compatible names and defaults, normalization, and validation."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sprig.runtime.sampling import SamplingParams
from sprig.runtime.wire import decode, encode


def test_defaults_match_sglang() -> None:
    p = SamplingParams.from_dict(None)
    assert p == SamplingParams.from_dict({})
    assert (p.max_new_tokens, p.min_new_tokens, p.temperature, p.top_p, p.top_k) == (
        128,
        0,
        1.0,
        1.0,
        -1,
    )
    assert (p.min_p, p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (
        0.0,
        0.0,
        0.0,
        1.0,
    )
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.n, p.seed, p.logit_bias) == (
        (),
        (),
        False,
        1,
        None,
        None,
    )
    assert p.skip_special_tokens and p.spaces_between_special_tokens and not p.no_stop_trim
    assert p.regex is None and p.json_schema is None and not p.is_greedy


def test_normalization() -> None:
    p = SamplingParams.from_dict(
        {
            "stop": "###",
            "stop_token_ids": [7, 3, 7],
            "logit_bias": {"5": 2, 9: -1.5},
            "sampling_seed": 11,
            "max_new_tokens": 16.0,
            "top_k": 0,
            "json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "temperature": None,
        }
    )
    assert p.stop == ("###",)
    assert p.stop_token_ids == (7, 3)
    assert p.logit_bias == {5: 2.0, 9: -1.5}
    assert p.seed == 11
    assert p.max_new_tokens == 16 and isinstance(p.max_new_tokens, int)
    assert p.top_k == -1
    assert json.loads(p.json_schema or "") == {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
    }
    assert p.temperature == 1.0


@pytest.mark.parametrize(
    ("d", "greedy"),
    [({"temperature": 0}, True), ({"top_k": 1}, True), ({"temperature": 1e-9}, True), ({}, False)],
)
def test_is_greedy(d: dict, greedy: bool) -> None:
    assert SamplingParams.from_dict(d).is_greedy is greedy


def test_stop_token_set_respects_ignore_eos() -> None:
    p = SamplingParams(stop_token_ids=(5,))
    assert p.stop_token_set([2]) == {2, 5}
    assert SamplingParams(stop_token_ids=(5,), ignore_eos=True).stop_token_set([2]) == {5}


def test_round_trip_through_the_wire() -> None:
    p = SamplingParams(
        stop=("a", "b"), stop_token_ids=(1,), logit_bias={3: 1.0}, seed=2**63 + 5, regex="x+"
    )
    assert decode(encode(p)) == p and decode(encode(p)).stop == ("a", "b")


@settings(max_examples=50, deadline=None)
@given(
    temperature=st.floats(0, 5),
    top_p=st.floats(0.01, 1),
    top_k=st.integers(-1, 1000),
    bias=st.dictionaries(st.integers(0, 10**6), st.floats(-100, 100), max_size=5),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=4),
)
def test_round_trip_property(
    temperature: float, top_p: float, top_k: int, bias: dict[int, float], stop: list[str]
) -> None:
    p = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, logit_bias=bias, stop=tuple(stop)
    )
    assert decode(encode(p)) == p


BAD = [
    ("max_new_tokens", -1),
    ("max_new_tokens", 1.5),
    ("max_new_tokens", True),
    ("max_new_tokens", "8"),
    ("min_new_tokens", -1),
    ("temperature", -0.1),
    ("temperature", float("inf")),
    ("temperature", float("nan")),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", False),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("presence_penalty", 3),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
    ("n", 0),
    ("n", 129),
    ("ignore_eos", 1),
    ("skip_special_tokens", "yes"),
    ("no_stop_trim", 0),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [f"s{i}" for i in range(17)]),
    ("stop", 5),
    ("stop", ["a", 3]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", 3),
    ("stop_token_ids", list(range(1025))),
    ("seed", 1.5),
    ("seed", 2**64),
    ("seed", True),
    ("logit_bias", {"1": 101}),
    ("logit_bias", {"1": -100.5}),
    ("logit_bias", {"x": 1}),
    ("logit_bias", {"-3": 1}),
    ("logit_bias", [1, 2]),
    ("logit_bias", {str(i): 1 for i in range(1025)}),
    ("regex", 5),
    ("json_schema", "{not json"),
    ("json_schema", 5),
]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r}"[:40] for n, v in BAD])
def test_bad_value_names_the_parameter(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams.from_dict({name: value})


def test_min_new_tokens_bounded_by_max() -> None:
    with pytest.raises(ValueError, match=r"min_new_tokens must be in \[0, max_new_tokens=4\]"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)


def test_range_is_stated() -> None:
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]; got 0"):
        SamplingParams(top_p=0)


@pytest.mark.parametrize("key", ["bogus", "max_tokens"])
def test_unknown_key_is_named(key: str) -> None:
    with pytest.raises(ValueError, match=key):
        SamplingParams.from_dict({key: 1})


def test_structural_errors() -> None:
    with pytest.raises(ValueError, match="mutually exclusive"):
        SamplingParams(regex="a", json_schema="{}")
    assert SamplingParams.from_dict({"ebnf": 'root ::= "a"'}).ebnf == 'root ::= "a"'
    with pytest.raises(ValueError, match="json_schema and ebnf are mutually exclusive"):
        SamplingParams(json_schema="{}", ebnf='root ::= "a"')
    with pytest.raises(ValueError, match=r"ebnf must be a grammar of 1 to 65536 characters; got 'rrr"):
        SamplingParams(ebnf="r" * (64 * 1024 + 1))
    with pytest.raises(ValueError, match="ebnf must be"):
        SamplingParams.from_dict({"ebnf": ["root ::= 'a'"]})
    with pytest.raises(ValueError, match="seed"):
        SamplingParams.from_dict({"seed": 1, "sampling_seed": 2})
    with pytest.raises(ValueError, match="sampling_params"):
        SamplingParams.from_dict([("top_k", 1)])  # type: ignore[arg-type]


def test_validate_for_model() -> None:
    SamplingParams(stop_token_ids=(9,), logit_bias={9: 1.0}).validate_for_model(10)
    with pytest.raises(ValueError, match=r"stop_token_ids must be token ids in \[0, 10\)"):
        SamplingParams(stop_token_ids=(10,)).validate_for_model(10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"12": 1}).validate_for_model(10)


def test_frozen_and_caller_dict_not_shared() -> None:
    bias = {1: 2.0}
    p = SamplingParams(logit_bias=bias)
    bias[1] = 50.0
    assert p.logit_bias == {1: 2.0}
    with pytest.raises(AttributeError):
        p.top_k = 3  # type: ignore[misc]
