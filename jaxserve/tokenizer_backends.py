"""The two tokenizer backends a checkpoint folder can hold: HF `tokenizers` over `tokenizer.json` (GLM, the tiny
model) and Kimi's `tiktoken.model` (base64 rank lines + 256 reserved specials).

Both encode long texts piece by piece at safe pre-token boundaries (`encode(..., limit=N)` stops once more than N
ids are known), expose their special ids and control strings, and give each id's bytes for exact streaming.
"""
from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tiktoken
import tokenizers

from jaxserve.errors import CheckpointError, ConfigError

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


def read_json(path: Path) -> dict[str, Any] | None:
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


def token_content(value: Any) -> str | None:
    """A special-token entry as written by HF (plain string or {"content": ...}) -> str | None."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def int_list(value: Any) -> list[int]:
    """An `eos_token_id` field (int, list of ints or null) -> list[int]."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []



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


class HFBackend:
    """HF `tokenizers` backend over tokenizer.json."""

    kind = "tokenizers"

    def __init__(self, path: Path) -> None:
        raw = read_json(path) or {}
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


class TiktokenBackend:
    """Kimi `tiktoken.model` backend: base64 rank lines + 256 reserved specials after the base vocab."""

    kind = "tiktoken"
    byte_level = True

    def __init__(self, path: Path, added_tokens_decoder: dict[str, Any]) -> None:
        ranks = self._load_ranks(path)
        self.num_base_tokens: int = len(ranks)
        specials: dict[str, int] = {}
        for key, entry in added_tokens_decoder.items():
            content = token_content(entry)
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
