"""Chat templates: the checkpoint's own Jinja template compiled in a sandbox configured like HF transformers
(`tojson`, `raise_exception`, `strftime_now`, loop controls)."""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxserve.errors import ConfigError


def sorted_deep(value: Any) -> Any:
    """Dicts with keys sorted at every depth (Kimi sorts tool schemas before rendering) -> same shape."""
    if isinstance(value, dict):
        return {k: sorted_deep(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [sorted_deep(v) for v in value]
    return value


def _raise_exception(message: str) -> None:
    """Jinja global `raise_exception`, as HF chat templates expect."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Jinja filter `tojson` with HF's signature (non-ASCII kept, no HTML escaping) -> str."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """Jinja global `strftime_now` used by some templates for the current date -> str."""
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox configured like HF transformers -> jinja2.Template."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ConfigError(f"chat_template does not compile: {e}", value=source[:200], param="chat_template") from e
