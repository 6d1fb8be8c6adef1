"""Each grammar backend on the SmolLM2 tokenizer: compile, bitmask contents, accept,
rollback, termination on EOS, and the constructs one backend lacks."""

from __future__ import annotations

from typing import Any

import pytest
from so_helpers import BACKENDS, EOS, SCHEMA, allowed, fill

from tandem.schema.request_checks import RequestRejectedError
from tandem.schema.structured_outputs import StructuredOutputsParams
from tandem.structured_output.backend import allocate_bitmask


def start(backends: dict[str, Any], name: str, **spec: Any) -> tuple[Any, Any]:
    backend = backends[name]
    params = StructuredOutputsParams(**spec)
    backend.check(params)
    return backend, backend.matcher(backend.compile(params))


@pytest.mark.parametrize("name", BACKENDS)
def test_json_schema_first_tokens_open_an_object(
    backends: dict[str, Any], tokenizer: Any, name: str
) -> None:
    backend, matcher = start(backends, name, json=SCHEMA)
    first = fill(matcher, 49152)
    assert first, "nothing allowed at the start"
    assert EOS not in first
    assert all(tokenizer.decode([t]).startswith("{") for t in first)
    assert tokenizer.encode("{")[0] in first
    assert tokenizer.encode("hello")[0] not in first


@pytest.mark.parametrize("name", BACKENDS)
def test_valid_document_is_accepted_then_only_eos_then_terminated(
    backends: dict[str, Any], tokenizer: Any, name: str
) -> None:
    _, matcher = start(backends, name, json=SCHEMA)
    for token in tokenizer.encode('{"x":12,"tag":"b"}'):
        assert matcher.accept_token(token), tokenizer.decode([token])
    assert fill(matcher, 49152) == {EOS}
    assert not matcher.is_terminated()
    assert matcher.accept_token(EOS)
    assert matcher.is_terminated()
    assert not matcher.accept_token(EOS)


@pytest.mark.parametrize("name", BACKENDS)
def test_rejected_token_leaves_the_state_and_rollback_restores_it(
    backends: dict[str, Any], tokenizer: Any, name: str
) -> None:
    _, matcher = start(backends, name, json=SCHEMA)
    at_start = fill(matcher, 49152)
    assert not matcher.accept_token(tokenizer.encode("hello")[0])
    assert fill(matcher, 49152) == at_start
    tokens = tokenizer.encode('{"x":1')
    for token in tokens:
        assert matcher.accept_token(token)
    assert fill(matcher, 49152) != at_start
    matcher.rollback(len(tokens))
    assert fill(matcher, 49152) == at_start
    # Rollback over the stop token too.
    for token in tokenizer.encode('{"x":1,"tag":"a"}'):
        assert matcher.accept_token(token)
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    matcher.rollback(1)
    assert not matcher.is_terminated()
    assert fill(matcher, 49152) == {EOS}


@pytest.mark.parametrize("name", BACKENDS)
def test_choice_allows_exactly_the_choices(
    backends: dict[str, Any], tokenizer: Any, name: str
) -> None:
    _, matcher = start(backends, name, choice=["yes", "no (maybe)"])
    first = {tokenizer.decode([t]) for t in fill(matcher, 49152)}
    assert "yes" in first and "no" in first
    assert all("yes".startswith(s) or "no (maybe)".startswith(s) for s in first)
    for token in tokenizer.encode("no (maybe)"):
        assert matcher.accept_token(token)
    assert fill(matcher, 49152) == {EOS}


@pytest.mark.parametrize("name", BACKENDS)
def test_regex_constrains_and_terminates(
    backends: dict[str, Any], tokenizer: Any, name: str
) -> None:
    _, matcher = start(backends, name, regex=r"[0-9]{3}-[a-z]+")
    assert not matcher.accept_token(tokenizer.encode("x")[0])
    for token in tokenizer.encode("123-ab"):
        assert matcher.accept_token(token)
    after = fill(matcher, 49152)
    assert EOS in after and tokenizer.encode("c")[0] in after  # may stop or go on
    assert matcher.accept_token(EOS) and matcher.is_terminated()


def test_ebnf_compiles_on_xgrammar_and_is_refused_by_outlines_naming_xgrammar(
    backends: dict[str, Any], tokenizer: Any
) -> None:
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+'
    _, matcher = start(backends, "xgrammar", grammar=grammar)
    for token in tokenizer.encode("(1+22)"):
        assert matcher.accept_token(token)
    assert fill(matcher, 49152) == {EOS}
    with pytest.raises(RequestRejectedError, match="structured_outputs.grammar.*'xgrammar'"):
        backends["outlines"].check(StructuredOutputsParams(grammar=grammar))


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(
    ("pattern", "feature"),
    [("(?=a)b", "lookaround"), (r"(a)\1", "backreferences"), ("[a-", "invalid regex")],
)
def test_unsupported_regex_is_refused_synchronously(
    backends: dict[str, Any], name: str, pattern: str, feature: str
) -> None:
    with pytest.raises(RequestRejectedError, match=f"structured_outputs.regex: .*{feature}"):
        backends[name].check(StructuredOutputsParams(regex=pattern))


@pytest.mark.parametrize("name", BACKENDS)
def test_invalid_schema_fails_at_compile(backends: dict[str, Any], name: str) -> None:
    with pytest.raises(Exception, match="nonsense"):
        backends[name].compile(StructuredOutputsParams(json={"type": "nonsense"}))


@pytest.mark.parametrize("name", BACKENDS)
def test_batch_fill_writes_only_the_given_rows(
    backends: dict[str, Any], tokenizer: Any, name: str
) -> None:
    backend, m1 = start(backends, name, json=SCHEMA)
    _, m2 = start(backends, name, regex="[0-9]+")
    bitmask = allocate_bitmask(3, 49152)
    backend.fill_bitmasks([m1, m2], bitmask, [2, 0])
    assert allowed(bitmask, 2, 49152) == fill(m1, 49152)
    assert allowed(bitmask, 0, 49152) == fill(m2, 49152)
    assert bool((bitmask[1] == -1).all())
