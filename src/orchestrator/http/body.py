"""Request bodies: read within the size limit, then decoded with the checks msgspec does not make.

msgspec decodes strictly, but invalid UTF-8 raises `UnicodeDecodeError` (not
`DecodeError`, and not at all in a field it skips), each nesting level is one C
recursion (a deep body is a `RecursionError`), and ``\\u0000`` decodes to a NUL
character. So the body's nesting and UTF-8 are checked first, in linear scans,
and NUL escapes are refused after decoding.

Unknown fields are ignored, at any depth, and their paths returned to be
logged (`Service.read`), as vLLM does: a client's new field never breaks a
request. Request Structs forbid unknown fields, so the usual body (none)
decodes in one strict pass; only a body that has some is decoded again as
plain JSON, stripped of what the schema does not declare (`strip_unknown`)
and converted. Known fields keep their checks: a bad value is a 400 naming it.

A body over the limit is read to its end (up to `DRAIN_LIMIT_BYTES`, and
dropped) before the 413 goes out: closing a connection with unread bytes makes
the kernel reset it, and a client still sending never reads its 413.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import msgspec
import msgspec.inspect as mi
from starlette.requests import Request
from starlette.types import Receive

from .errors import HttpError, from_decode_error
from .streaming import ClientGone

#: Arrays and objects nested deeper than this are refused (400); requests need 4 levels.
MAX_JSON_DEPTH = 64
#: A refused body is read and dropped up to this many bytes so its client reads the 413.
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024

# A JSON string literal: its brackets are text, not nesting.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_OPENERS = frozenset(b"[{")
# An escape (preceded by an even run of backslashes) of NUL, or of a UTF-16 surrogate (a pair kept whole).
_ESCAPE = rb"(?<!\\)(?:\\\\)*(?P<esc>\\u"
_NUL = re.compile(_ESCAPE + rb"0000)")
_HIGH, _LOW = rb"[dD][89abAB][0-9a-fA-F]{2}", rb"[dD][c-fC-F][0-9a-fA-F]{2}"
_SURROGATE = re.compile(_ESCAPE + rb"(?:" + _HIGH + rb"(?P<low>\\u" + _LOW + rb")?|" + _LOW + rb"))")


def too_large(limit: int) -> HttpError:
    return HttpError(413, f"request body is larger than {limit} bytes (server option --max-body-bytes)",
                     code="body_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes; else `HttpError` 413, once the client is done sending."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        if request.headers.get("expect", "").lower() != "100-continue":  # that client waits: it sent nothing
            await _drain(request.receive)
        raise too_large(limit)
    body = bytearray()
    more = True
    while more:
        part, more = await _next_part(request.receive)
        body += part
        if len(body) > limit:
            if more:
                await _drain(request.receive)
            raise too_large(limit)
    return bytes(body)


async def _next_part(receive: Receive) -> tuple[bytes, bool]:
    """The next piece of the body and whether more follows; `ClientGone` if the client hung up."""
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    return message.get("body", b""), message.get("more_body", False)


async def _drain(receive: Receive) -> None:
    """Read and drop the rest of the body, up to `DRAIN_LIMIT_BYTES`."""
    dropped, more = 0, True
    while more and dropped <= DRAIN_LIMIT_BYTES:
        part, more = await _next_part(receive)
        dropped += len(part)


def decode(body: bytes, decoder: msgspec.json.Decoder, prefix: str = "", ignored: list[str] | None = None
           ) -> Any:
    """`body` decoded by `decoder`; `HttpError` 400 naming the problem, never another error.

    Fields the schema does not declare are dropped, their paths (``messages[2].foo``) appended to
    `ignored`. Refused: an empty body, nesting deeper than `MAX_JSON_DEPTH`, invalid UTF-8, lone
    UTF-16 surrogate escapes, NUL (``\\u0000``) in any string, and a declared field's bad value.
    """
    if not body:
        raise HttpError(400, "request body is empty: expected a JSON object", code="invalid_json")
    check_depth(body)
    try:
        body.decode()  # all of it: msgspec does not check the strings of fields it skips
    except UnicodeDecodeError as exc:
        raise HttpError(400, f"malformed JSON body: not valid UTF-8 (byte {exc.start})",
                        code="invalid_json") from None
    try:
        value = decoder.decode(body)
    except RecursionError:  # unreachable past check_depth; kept so no body can be a 500
        raise _too_deep() from None
    except msgspec.DecodeError as exc:
        if isinstance(exc, msgspec.ValidationError) and _UNKNOWN_FIELD in str(exc):
            value = _decode_lenient(body, decoder.type, prefix, [] if ignored is None else ignored)
            return _check_nul(body, value)
        lone = _lone_surrogate(body)
        if lone is not None:  # msgspec's own message is "Input data was truncated" for some
            raise HttpError(400, f"malformed JSON body: unpaired UTF-16 surrogate escape at byte {lone}",
                            code="invalid_json") from None
        raise from_decode_error(exc, prefix) from None
    return _check_nul(body, value)


def _check_nul(body: bytes, value: Any) -> Any:
    if b"\\u0000" in body and (m := _NUL.search(body)):
        raise HttpError(400, f"invalid request body: strings must not contain NUL (\\u0000); "
                             f"one is at byte {m.start('esc')}", code="invalid_string")
    return value


#: msgspec's message for a field a Struct does not declare (its other errors name declared fields).
_UNKNOWN_FIELD = "Object contains unknown field"


def _decode_lenient(body: bytes, type_: Any, prefix: str, ignored: list[str]) -> Any:
    """The slow path of `decode`: plain JSON, unknown fields dropped (and named), then converted."""
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc, prefix) from None
    return convert(raw, type_, prefix, ignored)


def convert(raw: Any, type_: Any, path: str, ignored: list[str]) -> Any:
    """`raw` (plain JSON values) as `type_`, fields it does not declare dropped and their paths, under
    `path`, appended to `ignored`; `HttpError` 400 naming a declared field with a bad value."""
    try:
        return msgspec.convert(raw, type_)  # the usual case: nothing unknown, one strict pass
    except msgspec.ValidationError as exc:
        if _UNKNOWN_FIELD not in str(exc):
            raise _at(exc, path) from None
    strip_unknown(raw, _info(type_), path, ignored)
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as exc:
        raise _at(exc, path) from None


def _at(exc: msgspec.ValidationError, path: str) -> HttpError:
    """msgspec's error as a 400, its path (which starts at the value converted) made the body's."""
    if path:
        text = str(exc)
        text = text.replace("`$", f"`$.{path}") if "`$" in text else f"{text} - at `$.{path}`"
        exc = msgspec.ValidationError(text)
    return from_decode_error(exc)


@functools.lru_cache(maxsize=64)
def _info(type_: Any) -> mi.Type:
    return mi.type_info(type_)


def strip_unknown(value: Any, t: mi.Type, path: str, ignored: list[str]) -> None:
    """Delete from `value` (plain JSON, in place) the object keys `t` does not declare, at any depth,
    appending each one's path; what does not match `t` is left for msgspec to refuse."""
    if isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.UnionType):
        t = _member(value, t)
    if isinstance(t, mi.StructType) and isinstance(value, dict):
        fields = _fields(t)
        # A Struct that does not forbid unknown fields skips them in the fast path too: nothing to name.
        strict = t.forbid_unknown_fields
        unknown = [k for k in value if k not in fields and k != t.tag_field] if strict else []
        for key in unknown:
            del value[key]
            ignored.append(f"{path}.{key}" if path else key)
        for key, item in value.items():
            ft = fields.get(key)
            if ft is not None:
                strip_unknown(item, ft, f"{path}.{key}" if path else key, ignored)
    elif isinstance(t, (mi.ListType, mi.VarTupleType)) and isinstance(value, list):
        for i, item in enumerate(value):
            strip_unknown(item, t.item_type, f"{path}[{i}]", ignored)
    elif isinstance(t, mi.DictType) and isinstance(value, dict):
        for key, item in value.items():
            strip_unknown(item, t.value_type, f"{path}.{key}" if path else str(key), ignored)


def _fields(t: mi.StructType) -> dict[str, mi.Type]:
    return {f.encode_name: f.type for f in t.fields}


def _member(value: Any, t: mi.UnionType) -> mi.Type | None:
    """The member of a union that `value` decodes as (msgspec allows one per JSON kind, or a tagged
    set of Structs); None if none fits."""
    for m in t.types:
        m = m.type if isinstance(m, mi.Metadata) else m
        if isinstance(value, dict):
            if isinstance(m, mi.DictType):
                return m
            if isinstance(m, mi.StructType) and (m.tag_field is None or value.get(m.tag_field) == m.tag):
                return m
        elif isinstance(value, list) and isinstance(m, (mi.ListType, mi.VarTupleType)):
            return m
    return None


def check_depth(body: bytes) -> None:
    """`HttpError` 400 if arrays and objects in `body` nest deeper than `MAX_JSON_DEPTH`.

    A linear scan of the brackets outside string literals, no recursion; a malformed
    body passes or fails here as it may, and msgspec reports it.
    """
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return  # cannot nest deeper than it has brackets
    depth = 0
    for c in _STRING.sub(b"", body).translate(None, _NOT_BRACKETS):
        if c in _OPENERS:
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
        else:
            depth -= 1


def _too_deep() -> HttpError:
    return HttpError(400, f"malformed JSON body: arrays and objects nest deeper than {MAX_JSON_DEPTH} levels",
                     code="invalid_json")


def _lone_surrogate(body: bytes) -> int | None:
    """The byte offset of the first unpaired ``\\ud800``-``\\udfff`` escape in `body`, if any."""
    for m in _SURROGATE.finditer(body):
        high = m["esc"][3] in b"89abAB"
        if not high or m["low"] is None:
            return m.start("esc")
    return None
