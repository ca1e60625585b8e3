"""Tokenizers for served checkpoints: HF `tokenizer.json` (GLM, the tiny model) or Kimi `tiktoken.model`.

`Tokenizer(folder)` picks the backend from the files present, reads special tokens and stop ids from
`tokenizer_config.json` / `generation_config.json` / `config.json`, and renders the checkpoint's own Jinja
chat template in a sandbox. `StreamDecoder` turns a token stream into text without ever emitting half a
UTF-8 character; for byte-level vocabularies (tiktoken, ByteLevel tokenizer.json) the concatenation of its
outputs is exactly `Tokenizer.decode` of all ids.

User-supplied text must never become control tokens: `encode(text, special_tokens=False)` encodes special-token
strings as ordinary text, and `encode_chat` renders the chat template so that only the template's own control
tokens are ids (a special-token string inside any message, tool schema or argument is encoded as text).
`encode(..., limit=N)` stops once more than N ids are known, encoding long texts piece by piece (the ids of the
whole text), so an oversized prompt costs about N tokens of work and never holds the GIL for long.
"""
from __future__ import annotations

import base64
import binascii
import codecs
import json
import re
import secrets
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tiktoken
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxserve.errors import CheckpointError, ConfigError, InvalidRequestError

# Kimi's TikTokenTokenizer.pat_str (MODEL_FORMATS.md §1.6); `&&` intersections need tiktoken's fancy-regex.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
KIMI_NUM_RESERVED_SPECIAL_TOKENS = 256
# Kimi's guards against tiktoken's stack overflow on huge inputs; they change tokens at the seams, so keep them.
KIMI_MAX_ENCODE_CHARS = 400_000
KIMI_MAX_NO_WHITESPACE_CHARS = 25_000
# One encode call covers about this many characters (HF tokenizers holds the GIL while encoding: ~5 ms here).
PIECE_CHARS = 8192
# A single space between two non-spaces is a pre-token boundary of the GPT-2, cl100k/GLM and Kimi split patterns
# (no pattern ends in a space or lets a space continue a token), so pieces cut there encode to the whole's ids.
_SAFE_CUT = re.compile(r"(?<=\S) (?=\S)")


def _pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """`text` cut at safe pre-token boundaries into pieces of about `size` chars (longer where none exists)."""
    start = 0
    while len(text) - start > size:
        m = _SAFE_CUT.search(text, start + size)
        if m is None:
            break
        yield text[start : m.start()]
        start = m.start()
    yield text[start:]


def _encode_pieces(encode: Any, text: str, limit: int | None, chunkable: bool) -> list[int]:
    """ids of `text` with `encode(piece) -> list[int]`, stopping once more than `limit` ids are known."""
    if not chunkable or len(text) <= PIECE_CHARS:
        return encode(text)
    ids: list[int] = []
    for piece in _pieces(text):
        ids.extend(encode(piece))
        if limit is not None and len(ids) > limit:
            break
    return ids


def _read_json(path: Path) -> dict[str, Any] | None:
    """Parse a JSON object file, None if absent -> dict | None. Raises CheckpointError if unreadable."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot parse {path.name}: {e}", value=str(path), param=path.name) from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path.name} is not a JSON object", value=str(path), param=path.name)
    return data


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable char table used by ByteLevel vocabularies -> dict[int, str]."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _token_content(value: Any) -> str | None:
    """A special-token entry as written by HF (plain string or {"content": ...}) -> str | None."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _int_list(value: Any) -> list[int]:
    """An `eos_token_id` field (int, list of ints or null) -> list[int]."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _sorted_deep(value: Any) -> Any:
    """Dicts with keys sorted at every depth (Kimi sorts tool schemas before rendering) -> same shape."""
    if isinstance(value, dict):
        return {k: _sorted_deep(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_deep(v) for v in value]
    return value


def _split_long_runs(text: str, limit: int) -> list[str]:
    """Kimi's `_split_whitespaces_or_nonwhitespaces`: cut runs of > limit (non-)whitespace chars -> list[str]."""
    # Fast path: the per-char loop below only matters when such a run exists (re's \s == str.isspace).
    if re.search(r"\s{%d,}|\S{%d,}" % (limit + 1, limit + 1), text) is None:
        return [text]
    pieces = []
    run_len = 0
    run_is_space = text[0].isspace() if text else False
    start = 0
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        if run_is_space ^ is_space:
            run_len = 1
            run_is_space = is_space
        else:
            run_len += 1
            if run_len > limit:
                pieces.append(text[start:i])
                start = i
                run_len = 1
    pieces.append(text[start:])
    return pieces


class _HFBackend:
    """HF `tokenizers` backend over tokenizer.json."""

    kind = "tokenizers"

    def __init__(self, path: Path) -> None:
        raw = _read_json(path) or {}
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"cannot load tokenizer.json: {e}", value=str(path), param="tokenizer.json") from e
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids: frozenset[int] = frozenset(
            t["id"] for t in raw.get("added_tokens", []) if isinstance(t, dict) and t.get("special")
        )
        added = [t for t in raw.get("added_tokens", []) if isinstance(t, dict) and isinstance(t.get("content"), str)]
        # every added token is matched in text by `encode` (special or not): all of them are control strings
        self.control_strings: tuple[str, ...] = tuple(t["content"] for t in added)
        self._plain = tokenizers.Tokenizer.from_file(str(path))
        self._plain.encode_special_tokens = True  # added-token strings are split like ordinary text
        pre = raw.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        byte_level = [p for p in steps if isinstance(p, dict) and p.get("type") == "ByteLevel"]
        splits = [p for p in steps if isinstance(p, dict) and p.get("type") == "Split"]
        gpt_split = all(r"\s+(?!\S)" in str((p.get("pattern") or {}).get("Regex", "")) for p in splits)
        # Piecewise encoding is exact only for the known byte-level split patterns without a normalizer or prefix
        # space (a Metaspace prefix or a normalizer would change the text at each cut).
        self.chunkable: bool = (raw.get("normalizer") is None and len(byte_level) == 1 and gpt_split
                                and not byte_level[0].get("add_prefix_space", False)
                                and (byte_level[0].get("use_regex", True) or len(splits) == 1))
        # with special tokens matched, a cut must not split one or move an lstrip/rstrip token's whitespace
        self._chunkable_special = self.chunkable and not any(
            " " in t["content"] or t.get("lstrip") or t.get("rstrip") for t in added)
        # ByteLevel token strings have one char per byte; text covers at most that many chars per token (None:
        # a normalizer may delete text, so no such bound holds)
        longest = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        self.max_token_chars: int | None = longest if raw.get("normalizer") is None else None
        decoder = raw.get("decoder")
        # Only a bare ByteLevel decoder is a plain concatenation of per-token bytes.
        self.byte_level: bool = isinstance(decoder, dict) and decoder.get("type") == "ByteLevel"
        self._char_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        self._bytes_cache: dict[int, bytes] = {}

    def encode(self, text: str, special_tokens: bool, limit: int | None) -> list[int]:
        """Text -> ids (no BOS/EOS added); special_tokens: added-token strings in the text become their ids."""
        tok = self._tok if special_tokens else self._plain
        chunkable = self._chunkable_special if special_tokens else self.chunkable
        return _encode_pieces(lambda t: tok.encode(t, add_special_tokens=False).ids, text, limit, chunkable)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """Ids -> text."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Token string -> id, None if not in the vocabulary."""
        return self._tok.token_to_id(token)

    def has_id(self, token_id: int) -> bool:
        """Whether the id names a token (vocabularies may have holes)."""
        # Range first: the Rust binding overflows on negative or huge ids instead of returning None.
        return 0 <= token_id < self.vocab_size and self._tok.id_to_token(token_id) is not None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id decodes to (ByteLevel vocabularies only), as tokenizers' ByteLevel decoder does."""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            token = self._tok.id_to_token(token_id)
            assert token is not None, "caller validates ids"
            mapped = [self._char_to_byte.get(c) for c in token]
            # Same rule as the Rust decoder: a token with any char outside the table is taken as raw UTF-8.
            cached = token.encode("utf-8") if None in mapped else bytes(mapped)  # type: ignore[arg-type]
            self._bytes_cache[token_id] = cached
        return cached


class _TiktokenBackend:
    """Kimi `tiktoken.model` backend: base64 rank lines + 256 reserved specials after the base vocab."""

    kind = "tiktoken"
    byte_level = True

    def __init__(self, path: Path, added_tokens_decoder: dict[str, Any]) -> None:
        ranks = self._load_ranks(path)
        self.num_base_tokens: int = len(ranks)
        specials: dict[str, int] = {}
        for key, entry in added_tokens_decoder.items():
            content = _token_content(entry)
            if not key.isdigit() or content is None:
                raise ConfigError("bad added_tokens_decoder entry", value={key: entry}, param="added_tokens_decoder")
            token_id = int(key)
            if not self.num_base_tokens <= token_id < self.num_base_tokens + KIMI_NUM_RESERVED_SPECIAL_TOKENS:
                raise ConfigError(
                    f"special token id outside [{self.num_base_tokens}, {self.num_base_tokens + KIMI_NUM_RESERVED_SPECIAL_TOKENS})",
                    value=token_id,
                    param="added_tokens_decoder",
                )
            if content in specials:
                raise ConfigError("duplicate special token", value=content, param="added_tokens_decoder")
            specials[content] = token_id
        taken = set(specials.values())
        for token_id in range(self.num_base_tokens, self.num_base_tokens + KIMI_NUM_RESERVED_SPECIAL_TOKENS):
            if token_id not in taken:
                specials[f"<|reserved_token_{token_id}|>"] = token_id
        self.vocab_size: int = self.num_base_tokens + KIMI_NUM_RESERVED_SPECIAL_TOKENS
        self.special_ids: frozenset[int] = frozenset(specials.values())
        self.control_strings: tuple[str, ...] = tuple(specials)
        self.max_token_chars: int = max(max(len(b) for b in ranks), max(len(t) for t in specials))
        self._chunkable_special = not any(" " in t for t in specials)  # a cut must never split a special
        self._specials = specials
        self._enc = tiktoken.Encoding(
            name=path.parent.name or "kimi", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials
        )

    @staticmethod
    def _load_ranks(path: Path) -> dict[bytes, int]:
        """Parse `base64token rank` lines -> dict[bytes, int]. Raises CheckpointError on any malformed line."""
        ranks: dict[bytes, int] = {}
        for lineno, line in enumerate(path.read_text(encoding="ascii", errors="replace").splitlines(), start=1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise ValueError("expected 2 fields")
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (ValueError, binascii.Error) as e:
                raise CheckpointError(f"tiktoken.model line {lineno}: {e}", value=line, param="tiktoken.model") from e
            if token in ranks:
                raise CheckpointError(f"tiktoken.model line {lineno}: duplicate token", value=line, param="tiktoken.model")
            ranks[token] = rank
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise CheckpointError("tiktoken.model ranks are not exactly 0..n-1", value=len(ranks), param="tiktoken.model")
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            # BPE starts from single bytes: without all 256 some texts cannot be encoded.
            raise CheckpointError("tiktoken.model lacks single-byte tokens", value=missing[:16], param="tiktoken.model")
        return ranks

    def encode(self, text: str, special_tokens: bool, limit: int | None) -> list[int]:
        """Text -> ids with Kimi's chunking; special_tokens: special-token strings in the text become their ids."""
        allowed: Any = "all" if special_tokens else set()
        ids: list[int] = []
        for start in range(0, len(text), KIMI_MAX_ENCODE_CHARS):
            for run in _split_long_runs(text[start : start + KIMI_MAX_ENCODE_CHARS], KIMI_MAX_NO_WHITESPACE_CHARS):
                pieces = _pieces(run) if self._chunkable_special or not special_tokens else (run,)
                for piece in pieces:
                    ids.extend(self._enc.encode(piece, allowed_special=allowed, disallowed_special=()))
                    if limit is not None and len(ids) > limit:
                        return ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """Ids -> text (invalid UTF-8 becomes U+FFFD)."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._enc.decode(ids, errors="replace")

    def token_to_id(self, token: str) -> int | None:
        """Token string (special, or a base token whose bytes are its UTF-8) -> id, None if unknown."""
        if token in self._specials:
            return self._specials[token]
        try:
            return self._enc.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None

    def has_id(self, token_id: int) -> bool:
        """Whether the id names a token (ranks are contiguous, so any id below vocab_size does)."""
        return 0 <= token_id < self.vocab_size

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id decodes to."""
        return self._enc.decode_single_token_bytes(token_id)


def _left(limit: int | None, ids: list[int]) -> int | None:
    """What remains of an encode limit after `ids`."""
    return None if limit is None else max(limit - len(ids), 0)


def _raise_exception(message: str) -> None:
    """Jinja global `raise_exception`, as HF chat templates expect."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Jinja filter `tojson` with HF's signature (non-ASCII kept, no HTML escaping) -> str."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """Jinja global `strftime_now` used by some templates for the current date -> str."""
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox configured like HF transformers -> jinja2.Template."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ConfigError(f"chat_template does not compile: {e}", value=source[:200], param="chat_template") from e


class Tokenizer:
    """Tokenizer of one checkpoint folder.

    path: str | Path, folder with `tokenizer.json` (preferred) or `tiktoken.model`, plus optional
    `tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`, `config.json`.
    Raises ConfigError if the folder has neither tokenizer file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError("tokenizer path is not a directory", value=str(path), param="tokenizer")
        self._tokenizer_config: dict[str, Any] = _read_json(self.path / "tokenizer_config.json") or {}
        added = self._tokenizer_config.get("added_tokens_decoder") or {}
        if not isinstance(added, dict):
            raise ConfigError("added_tokens_decoder must be an object", value=added, param="added_tokens_decoder")
        if (self.path / "tokenizer.json").is_file():
            self._backend: _HFBackend | _TiktokenBackend = _HFBackend(self.path / "tokenizer.json")
        elif (self.path / "tiktoken.model").is_file():
            self._backend = _TiktokenBackend(self.path / "tiktoken.model", added)
        else:
            raise ConfigError("no tokenizer.json or tiktoken.model in checkpoint folder", value=str(self.path), param="tokenizer")
        self.bos_token: str | None = _token_content(self._tokenizer_config.get("bos_token"))
        self.eos_token: str | None = _token_content(self._tokenizer_config.get("eos_token"))
        self.chat_template: str | None = self._find_chat_template()
        self._template = _compile_chat_template(self.chat_template) if self.chat_template is not None else None
        self.eos_token_ids: tuple[int, ...] = self._find_eos_ids()

    @property
    def backend(self) -> str:
        """Which library encodes: "tokenizers" or "tiktoken" -> str."""
        return self._backend.kind

    @property
    def vocab_size(self) -> int:
        """Number of token ids including special/added tokens -> int."""
        return self._backend.vocab_size

    @property
    def byte_level(self) -> bool:
        """Whether decode is the UTF-8 decoding of concatenated per-token bytes (exact streaming) -> bool."""
        return self._backend.byte_level

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of special tokens -> frozenset[int]."""
        return self._backend.special_ids

    @property
    def control_strings(self) -> tuple[str, ...]:
        """The strings `encode` turns into single added/special ids when special_tokens=True -> tuple[str, ...]."""
        return self._backend.control_strings

    @property
    def max_token_chars(self) -> int | None:
        """An upper bound on the characters of text one id covers (None if the vocabulary gives none): a text of
        more than N * max_token_chars characters has more than N tokens, so it can be refused unencoded."""
        return self._backend.max_token_chars

    def _find_chat_template(self) -> str | None:
        """`chat_template.jinja` if present, else tokenizer_config's `chat_template` (str or named list) -> str | None."""
        jinja_file = self.path / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        template = self._tokenizer_config.get("chat_template")
        if isinstance(template, list):
            # HF's multi-template form: [{"name": "default", "template": ...}, {"name": "tool_use", ...}].
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise ConfigError("chat_template must be a string", value=template, param="chat_template")
        return template

    def _find_eos_ids(self) -> tuple[int, ...]:
        """Stop ids: generation_config, then tokenizer_config eos_token, then config.json (deduplicated) -> tuple[int, ...]."""
        ids: list[int] = []
        generation = _read_json(self.path / "generation_config.json") or {}
        ids += _int_list(generation.get("eos_token_id"))
        if self.eos_token is not None:
            eos_id = self._backend.token_to_id(self.eos_token)
            if eos_id is None:
                raise ConfigError("eos_token is not in the vocabulary", value=self.eos_token, param="eos_token")
            ids.append(eos_id)
        config = _read_json(self.path / "config.json") or {}
        ids += _int_list(config.get("eos_token_id"))
        text_config = config.get("text_config")
        if isinstance(text_config, dict):
            ids += _int_list(text_config.get("eos_token_id"))
        for token_id in ids:
            if not self._backend.has_id(token_id):
                raise ConfigError("eos_token_id outside the vocabulary", value=token_id, param="eos_token_id")
        return tuple(dict.fromkeys(ids))

    def _check_id(self, token_id: Any) -> int:
        """Validate one token id -> int. Raises InvalidRequestError carrying the bad id."""
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not self._backend.has_id(token_id):
            raise InvalidRequestError(f"token id not in vocabulary of size {self.vocab_size}", value=token_id, param="token_ids")
        return token_id

    def encode(self, text: str, special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """Text -> token ids (list[int]); no BOS is added.

        special_tokens: special-token strings in text map to their ids (False for user-supplied text: they are
        encoded as the ordinary text they spell). limit: stop once more than `limit` ids are known (the result
        is then a prefix longer than `limit`, enough to refuse the text without encoding all of it).
        """
        if not isinstance(text, str):
            raise InvalidRequestError("text to encode must be a string", value=type(text).__name__, param="prompt")
        return self._backend.encode(text, special_tokens, limit)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, limit: int | None = None) -> list[int]:
        """Render the chat template and encode it so that only the template's own text yields control tokens.

        Every control string inside a user-supplied string (message fields, tool schemas, tool-call arguments) is
        fenced by a per-call random marker before rendering; after rendering, fenced occurrences are encoded as
        ordinary text and the markers dropped. Text without such strings renders and encodes exactly as
        `encode(apply_chat_template(...))`. limit: as in `encode`.
        """
        if not self.control_strings:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools), limit=limit)
        nonce = secrets.token_hex(16)  # unguessable, and ASCII hex survives any escaping a template applies
        controls = "|".join(re.escape(t) for t in sorted(self.control_strings, key=len, reverse=True))
        find = re.compile(controls)

        def fence(value: Any) -> Any:
            if isinstance(value, str):
                return find.sub(lambda m: nonce + m.group(0) + nonce, value)
            if isinstance(value, dict):
                return {fence(k): fence(v) for k, v in value.items()}
            if isinstance(value, list):
                return [fence(v) for v in value]
            return value

        text = self.apply_chat_template(fence(messages), add_generation_prompt, fence(tools))
        ids: list[int] = []
        pos = 0
        for m in re.finditer(re.escape(nonce) + f"({controls}){re.escape(nonce)}", text):
            ids += self.encode(text[pos : m.start()].replace(nonce, ""), limit=_left(limit, ids))
            ids += self.encode(m.group(1), special_tokens=False)
            pos = m.end()
            if limit is not None and len(ids) > limit:
                return ids
        ids += self.encode(text[pos:].replace(nonce, ""), limit=_left(limit, ids))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Token ids -> text (str). Special tokens are kept by default so chat/tool markers survive."""
        checked = [self._check_id(i) for i in ids]
        return self._backend.decode(checked, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Token string -> id (int), None if unknown."""
        return self._backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one token (byte-level vocabularies only) -> bytes. Raises ConfigError otherwise."""
        if not self.byte_level:
            raise ConfigError("token_bytes needs a byte-level vocabulary", value=str(self.path), param="tokenizer")
        return self._backend.token_bytes(self._check_id(token_id))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> str:
        """Render messages (OpenAI-style dicts with "role") with the checkpoint's chat template -> str.

        tools: list[dict] | None, passed to the template as `tools` (keys deep-sorted for Kimi/tiktoken, as Kimi does).
        Raises ConfigError if the checkpoint has no template, InvalidRequestError if the template rejects the chat.
        """
        if self._template is None:
            raise ConfigError("checkpoint has no chat_template (tokenizer_config.json or chat_template.jinja)", value=str(self.path), param="chat_template")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise InvalidRequestError("messages must be a list of objects with a string 'role'", value=messages, param="messages")
        if tools is not None and self.backend == "tiktoken":
            tools = _sorted_deep(tools)
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.exceptions.TemplateError as e:
            raise InvalidRequestError(f"chat template rejected the messages: {e}", value=messages, param="messages") from e


class StreamDecoder:
    """Incremental detokenizer for one sequence: `push(id)` returns only newly completed text.

    tokenizer: Tokenizer. Byte-level vocabularies decode per-token bytes through an incremental UTF-8
    decoder, so `"".join(pushes) + flush() == tokenizer.decode(all_ids)` exactly. Other vocabularies
    (e.g. Metaspace/sentencepiece tokenizer.json) use the prefix-window text diff that HF TGI and vLLM use,
    holding back text that ends in U+FFFD (an unfinished byte-fallback character).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if tokenizer.byte_level else None
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window re-decoded with new ids (text mode)
        self._read = 0  # ids before this are already emitted (text mode)

    def push(self, token_id: int) -> str:
        """Add one token id -> str, the text it completes (possibly ""). Raises InvalidRequestError for a bad id."""
        if self._utf8 is not None:
            return self._utf8.decode(self._tokenizer.token_bytes(token_id))
        self._ids.append(self._tokenizer._check_id(token_id))
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        new_text = self._tokenizer.decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """End of sequence -> str, whatever was held back (an incomplete character becomes U+FFFD)."""
        if self._utf8 is not None:
            return self._utf8.decode(b"", final=True)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        new_text = self._tokenizer.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]
