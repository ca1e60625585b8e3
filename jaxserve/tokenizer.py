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

import codecs
import re
import secrets
from pathlib import Path
from typing import Any

import jinja2

from jaxserve.chat_template import compile_chat_template, sorted_deep
from jaxserve.errors import ConfigError, InvalidRequestError
from jaxserve.tokenizer_backends import HFBackend, TiktokenBackend, int_list, read_json, token_content


def _left(limit: int | None, ids: list[int]) -> int | None:
    """What remains of an encode limit after `ids`."""
    return None if limit is None else max(limit - len(ids), 0)



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
        self._tokenizer_config: dict[str, Any] = read_json(self.path / "tokenizer_config.json") or {}
        added = self._tokenizer_config.get("added_tokens_decoder") or {}
        if not isinstance(added, dict):
            raise ConfigError("added_tokens_decoder must be an object", value=added, param="added_tokens_decoder")
        if (self.path / "tokenizer.json").is_file():
            self._backend: HFBackend | TiktokenBackend = HFBackend(self.path / "tokenizer.json")
        elif (self.path / "tiktoken.model").is_file():
            self._backend = TiktokenBackend(self.path / "tiktoken.model", added)
        else:
            raise ConfigError("no tokenizer.json or tiktoken.model in checkpoint folder", value=str(self.path), param="tokenizer")
        self.bos_token: str | None = token_content(self._tokenizer_config.get("bos_token"))
        self.eos_token: str | None = token_content(self._tokenizer_config.get("eos_token"))
        self.chat_template: str | None = self._find_chat_template()
        self._template = compile_chat_template(self.chat_template) if self.chat_template is not None else None
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
        generation = read_json(self.path / "generation_config.json") or {}
        ids += int_list(generation.get("eos_token_id"))
        if self.eos_token is not None:
            eos_id = self._backend.token_to_id(self.eos_token)
            if eos_id is None:
                raise ConfigError("eos_token is not in the vocabulary", value=self.eos_token, param="eos_token")
            ids.append(eos_id)
        config = read_json(self.path / "config.json") or {}
        ids += int_list(config.get("eos_token_id"))
        text_config = config.get("text_config")
        if isinstance(text_config, dict):
            ids += int_list(text_config.get("eos_token_id"))
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
                    tools: list[dict[str, Any]] | None = None, limit: int | None = None,
                    variables: dict[str, Any] | None = None) -> list[int]:
        """Render the chat template and encode it so that only the template's own text yields control tokens.

        Every control string inside a user-supplied string (message fields, tool schemas, tool-call arguments) is
        fenced by a per-call random marker before rendering; after rendering, fenced occurrences are encoded as
        ordinary text and the markers dropped. Text without such strings renders and encodes exactly as
        `encode(apply_chat_template(...))`. limit: as in `encode`; variables: as in `apply_chat_template`.
        """
        if not self.control_strings:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, variables),
                               limit=limit)
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

        text = self.apply_chat_template(fence(messages), add_generation_prompt, fence(tools), fence(variables))
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

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, variables: dict[str, Any] | None = None) -> str:
        """Render messages (OpenAI-style dicts with "role") with the checkpoint's chat template -> str.

        tools: list[dict] | None, passed to the template as `tools` (keys deep-sorted for Kimi/tiktoken, as Kimi does).
        variables: more template variables (a request's `chat_template_kwargs`, e.g. `thinking`), under the
        standard ones, which they cannot replace.
        Raises ConfigError if the checkpoint has no template, InvalidRequestError if the template rejects the chat.
        """
        if self._template is None:
            raise ConfigError("checkpoint has no chat_template (tokenizer_config.json or chat_template.jinja)", value=str(self.path), param="chat_template")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise InvalidRequestError("messages must be a list of objects with a string 'role'", value=messages, param="messages")
        if tools is not None and self.backend == "tiktoken":
            tools = sorted_deep(tools)
        try:
            return self._template.render({
                **(variables or {}),
                "messages": messages,
                "tools": tools,
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token or "",
                "eos_token": self.eos_token or "",
            })
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
