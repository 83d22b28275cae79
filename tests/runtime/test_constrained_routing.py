"""The grammar router: free-form JSON schemas go to llguidance whatever the regular
backend is (outlines-core takes seconds to minutes to compile them), other schemas to the
regular one; a routed `json_object` grammar admits JSON objects and refuses other text."""

from __future__ import annotations

import pytest

from sprig.runtime.constrained import GrammarSpec
from sprig.runtime.constrained.routing import RoutedBackend
from sprig.runtime.tiny_checkpoint import build_tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.mark.parametrize("regular", ["outlines", "llguidance"])
def test_free_form_schemas_go_to_llguidance_the_rest_to_the_regular_backend(tokenizer, regular) -> None:
    backend = RoutedBackend.from_tokenizer(tokenizer, regular=regular)
    assert backend.context_free is not None
    for schema in ({"type": "object"}, {}, {"type": "object", "properties": {"data": {"title": "Data"}}}):
        assert backend.compile(GrammarSpec.json_schema(schema)).fingerprint == backend.context_free.fingerprint
    assert backend.compile(GrammarSpec.json_schema(PERSON)).fingerprint == backend.regular.fingerprint
    assert backend.compile(GrammarSpec.regex("[a-z]+")).fingerprint == backend.regular.fingerprint


@pytest.mark.parametrize(
    "text, valid",
    [('{"a": [1, {"b": null}], "c": "x"}', True), ("{}", True), ('{"a": 1', False), ("null", False)],
)
def test_a_routed_json_object_grammar_admits_json_objects_only(tokenizer, text, valid) -> None:
    backend = RoutedBackend.from_tokenizer(tokenizer, regular="outlines")
    grammar = backend.matcher(backend.prepare(backend.compile(GrammarSpec.json_schema({"type": "object"}))))
    accepted = all(grammar.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    assert (accepted and grammar.is_terminated()) is valid


def test_a_grammar_of_another_tokenizer_is_refused(tokenizer, tmp_path) -> None:
    backend = RoutedBackend.from_tokenizer(tokenizer)
    other = RoutedBackend.from_tokenizer(build_tokenizer(tmp_path, vocab_size=400))
    for schema in ({"type": "object"}, PERSON):
        with pytest.raises(ValueError, match="different tokenizer"):
            backend.matcher(other.compile(GrammarSpec.json_schema(schema)))
