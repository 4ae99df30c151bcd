"""Structured output at the edge: a JSON schema becomes the worker's `Grammar`, checked here first.

llguidance checks a grammar without a tokenizer and without MLX, so an
invalid schema, or a keyword it cannot enforce, is refused here with a
`ValueError` naming the field, and nothing reaches a worker. The worker
compiles the same grammar against the model's tokenizer
(`mlxrt.worker.grammar`); a failure there still fails the request alone.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jsonschema
import llguidance
import msgspec

from ..ipc.protocol import Grammar, InvalidField

#: OpenAI's ``json_object`` and Ollama's ``"json"``: any JSON object.
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


def json_schema_grammar(schema: Mapping[str, Any] | bool | str, field: str = "json_schema") -> Grammar:
    """The `Grammar` for a JSON schema (an object, a boolean schema, or its JSON text).

    Raises `ValueError` ``invalid <field>: ...`` for anything llguidance cannot enforce.
    """
    if isinstance(schema, str):
        try:
            decoded = msgspec.json.decode(schema)
        except msgspec.DecodeError as exc:
            raise InvalidField(field, f": not JSON ({exc})") from None
        source = schema
    else:
        decoded = schema
        try:
            source = msgspec.json.encode(schema).decode()
        except (TypeError, msgspec.EncodeError) as exc:
            raise InvalidField(field, f": not JSON-serialisable ({exc})") from None
    if not isinstance(decoded, (dict, bool)):
        kind = type(decoded).__name__
        raise InvalidField(field, f": a JSON schema is an object or a boolean, got {kind}")
    grammar = Grammar(kind="json_schema", source=source)
    problem = grammar_problem(grammar)
    if problem:
        raise InvalidField(field, f": {problem}")
    return grammar


def check_tool_schema(schema: Any, field: str) -> None:
    """`ValueError` ``invalid <field>: ...`` unless `schema` is a valid JSON schema of an object.

    A tool's input schema, checked against the JSON Schema meta-schema (its ``$schema``'s draft,
    else 2020-12, as Anthropic's API does) rather than by llguidance: a tool the model may call
    freely needs no grammar, so a valid keyword llguidance cannot enforce is no reason to refuse it.
    """
    if not isinstance(schema, dict):
        raise InvalidField(field, ": a JSON schema object is required")
    if schema.get("type") != "object":
        kind = schema.get("type")
        raise InvalidField(f"{field}.type", f'={kind!r}: must be "object" (a tool takes an object)')
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.path)
        raise InvalidField(field, f": not a valid JSON schema: {exc.message} (at {where or '.'})") from None


def check_grammar(grammar: Grammar) -> Grammar:
    """Return `grammar` if llguidance accepts it; `ValueError` ``invalid grammar: ...`` otherwise."""
    problem = grammar_problem(grammar)
    if problem:
        raise InvalidField("grammar", f" ({grammar.kind}): {problem}")
    return grammar


def grammar_problem(grammar: Grammar) -> str:
    """Why llguidance would refuse `grammar` ("" if it would not); remembered per grammar."""
    return _problem(grammar.kind, grammar.source)


@functools.lru_cache(maxsize=256)
def _problem(kind: str, source: str) -> str:
    L = llguidance.LLMatcher
    try:
        if kind == "json_schema":
            text = L.grammar_from_json_schema(source)
        elif kind == "regex":
            text = L.grammar_from_regex(source)
        else:
            text = L.grammar_from_lark(source)
        failed, messages = L.validate_grammar_with_warnings(text)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: B036 -- a Rust panic arrives as pyo3's PanicException(BaseException)
        return f"{type(exc).__name__}: {exc}"
    return messages[0] if failed else ""
