"""A request body as strict JSON and typed field access to it.

`require_json` refuses a body not declared JSON (415); `parse_json` decodes it as RFC 8259 JSON (no NaN/Infinity)
with no lone surrogate in any string and at most MAX_DEPTH levels of nesting (400). `Body` gives typed,
range-checked access to one JSON object's fields; every failure is an InvalidRequestError naming the field.
"""
from __future__ import annotations

import json
import math
from typing import Any

from jaxserve.errors import InvalidRequestError, MalformedBodyError, NotJsonError, UnsupportedParameterError
from jaxserve.server.limits import MAX_DEPTH, MAX_STOP_STRINGS


def json_kind(value: Any) -> str:
    """A JSON type name for messages (never the value itself, which may be huge)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def field_error(param: str, message: str, value: Any = None) -> InvalidRequestError:
    """The 400 for a bad field: the message names it as `'param': message`."""
    return InvalidRequestError(f"'{param}': {message}", value=value, param=param)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")  # json.loads accepts NaN/Infinity/-Infinity; RFC 8259 does not


def _is_utf8_text(s: str) -> bool:
    """No lone surrogate in `s` (ASCII is checked at memory speed; a regex scan would hold the GIL ~10x longer)."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_text(value: Any, path: str = "", depth: int = 0) -> None:
    """Refuse the first string (key or value) holding a lone surrogate: valid JSON (a \\ud800 escape), but no
    UTF-8 text, so no tokenizer can take it. Also refuse nesting deeper than MAX_DEPTH."""
    if depth > MAX_DEPTH:
        raise MalformedBodyError(f"the request body nests deeper than {MAX_DEPTH} levels (at '{path[:200]}')",
                                 value=depth, param=None)
    if isinstance(value, str):
        if not _is_utf8_text(value):
            raise field_error(path or "body", "is not valid Unicode text (a lone UTF-16 surrogate)")
    elif isinstance(value, dict):
        for k, v in value.items():
            name = f"{path}.{k[:64]}" if path else k[:64]
            if not _is_utf8_text(k):
                raise field_error(path or "body", "has a key that is not valid Unicode text (a lone UTF-16 surrogate)")
            _check_text(v, name, depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{path}[{i}]", depth + 1)


class UnknownFields:
    """What one request does with fields no schema here knows: refuse the first (strict, a 400 naming it) or
    collect their names (lenient, as vLLM does: the answer names them in a header and the server logs them)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.names: list[str] = []

    def found(self, names: list[str]) -> None:
        if self.strict and names:
            raise field_error(names[0], "unrecognized request argument", names[0])
        self.names += names


class Body:
    """Typed, range-checked access to a JSON object's fields; each failure is an InvalidRequestError naming the
    field (`prefix` names a nested object, e.g. "messages[2]"). `allowed` is the set of known keys; any other key
    goes to `unknown` (default: refused, so a typo is not silently ignored). A null field is always unset."""

    def __init__(self, raw: Any, allowed: frozenset[str], prefix: str = "",
                 unknown: UnknownFields | None = None) -> None:
        self.prefix = prefix
        self.unknown = unknown if unknown is not None else UnknownFields(strict=True)
        if not isinstance(raw, dict):
            if prefix:
                raise field_error(prefix, f"must be an object, got {json_kind(raw)}", json_kind(raw))
            raise MalformedBodyError(f"the request body must be a JSON object, got {json_kind(raw)}",
                                     value=json_kind(raw))
        self.unknown.found([self.name(k[:100]) for k in sorted(raw) if k not in allowed])
        self.raw = raw

    def child(self, raw: Any, allowed: frozenset[str], prefix: str) -> Body:
        """A nested object of this body, its unknown keys treated as this body's are."""
        return Body(raw, allowed, prefix, self.unknown)

    def choice(self, name: str, allowed: tuple[str, ...]) -> str | None:
        """A string field that must be one of `allowed` (None: unset)."""
        v = self.string(name)
        if v is not None and v not in allowed:
            raise field_error(self.name(name), f"must be one of {', '.join(allowed)}", v[:40])
        return v

    def obj(self, name: str) -> dict[str, Any] | None:
        """An object field, unread here (None: unset)."""
        v = self.raw.get(name)
        if v is not None and not isinstance(v, dict):
            raise field_error(self.name(name), f"must be an object, got {json_kind(v)}", json_kind(v))
        return v

    def name(self, field: str) -> str:
        return f"{self.prefix}.{field}" if self.prefix else field

    def has(self, name: str) -> bool:
        return self.raw.get(name) is not None

    def string(self, name: str, *, required: bool = False, default: str | None = None) -> str | None:
        v = self.raw.get(name)
        if v is None:
            if required:
                raise field_error(self.name(name), "is required")
            return default
        if not isinstance(v, str):
            raise field_error(self.name(name), f"must be a string, got {json_kind(v)}", json_kind(v))
        return v

    def integer(self, name: str, lo: int, hi: int, default: int | None = None) -> int | None:
        v = self.raw.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):  # bool is an int subclass in Python, not in JSON
            raise field_error(self.name(name), f"must be an integer, got {json_kind(v)}", json_kind(v))
        if not lo <= v <= hi:
            raise field_error(self.name(name),
                              f"must be in [{lo}, {hi}], got {v if abs(v) < 10**30 else 'a huge number'}",
                              v if abs(v) < 10**30 else None)
        return v

    def number(self, name: str, lo: float, hi: float, default: float, *, open_lo: bool = False) -> float:
        v = self.raw.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise field_error(self.name(name), f"must be a number, got {json_kind(v)}", json_kind(v))
        f = float(v) if not isinstance(v, int) or abs(v) < 10**300 else math.inf
        if not math.isfinite(f) or not (lo < f if open_lo else lo <= f) or f > hi:
            lo_s = f"({lo}" if open_lo else f"[{lo}"
            raise field_error(self.name(name), f"must be a number in {lo_s}, {hi}]", None)
        return f

    def boolean(self, name: str, default: bool) -> bool:
        v = self.raw.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise field_error(self.name(name), f"must be a boolean, got {json_kind(v)}", json_kind(v))
        return v

    def stop(self) -> tuple[str, ...]:
        v = self.raw.get("stop")
        if v is None:
            return ()
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
            raise field_error(self.name("stop"), "must be a non-empty string or an array of non-empty strings")
        if len(items) > MAX_STOP_STRINGS:
            raise field_error(self.name("stop"), f"at most {MAX_STOP_STRINGS} stop strings", len(items))
        return tuple(items)

    def token_ids(self, name: str, vocab: int) -> tuple[int, ...]:
        v = self.raw.get(name)
        if v is None:
            return ()
        if not isinstance(v, list) or not all(_is_token(t, vocab) for t in v):
            raise field_error(self.name(name), f"must be an array of token ids in [0, {vocab})")
        return tuple(v)

    def only(self, name: str, allowed: tuple[Any, ...], why: str) -> None:
        """A known parameter accepted only at its neutral value(s): anything else is an explicit 400."""
        v = self.raw.get(name)
        if v is None or (any(v == a and type(v) is type(a) for a in allowed)):
            return
        raise UnsupportedParameterError(f"'{self.name(name)}': {why}", value=json_kind(v), param=self.name(name))


def _is_token(t: Any, vocab: int) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab


def _is_json(content_type: str | None, params: dict[str, str]) -> bool:
    if content_type != "application/json" and not (content_type or "").endswith("+json"):
        return False
    return params.get("charset", "utf-8").lower() in ("utf-8", "utf8")  # RFC 8259: JSON text is UTF-8


def require_json(mimetype: str | None, params: dict[str, str], content_type: str | None) -> None:
    """Refuse (415) a body whose Content-Type is not JSON in UTF-8; checked before the body is read."""
    if not _is_json(mimetype, params):
        got = content_type or "none"
        raise NotJsonError(f"the request body must be JSON ('Content-Type: application/json'), got {got[:100]}",
                           value=got[:100], param="Content-Type")


def parse_json(data: bytes) -> Any:
    """The body's bytes -> its JSON value, refused (400) unless strict JSON of valid Unicode text."""
    try:
        raw = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # ValueError covers bad UTF-8, bad JSON, >4300-digit ints
        reason = "nesting too deep" if isinstance(e, RecursionError) else str(e)[:200]
        raise MalformedBodyError(f"the request body is not valid JSON: {reason}", value=None, param=None) from e
    _check_text(raw)
    return raw

