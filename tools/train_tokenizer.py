"""Train the tiny model's byte-level BPE tokenizer on the TRAIN split of the stdlib corpus.

Usage: `python -m tools.train_tokenizer OUT_DIR [--vocab-size 4096]`.
Writes `tokenizer.json`, `tokenizer_config.json` (Kimi-format Jinja `chat_template`, `eos_token`, no BOS),
`generation_config.json` (stop ids) and `training_meta.json` (corpus fingerprint, wall time).
Like Kimi, the special tokens sit right after the base vocabulary: ids `vocab_size - 6 .. vocab_size - 1`.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxserve.eval import corpus
from jaxserve.errors import ConfigError

EOS_TOKEN = "<|endoftext|>"
# Order fixes their ids: <|endoftext|> is the first id after the base vocab, as Kimi's [BOS]/[EOS] are.
SPECIAL_TOKENS: tuple[str, ...] = (
    EOS_TOKEN,
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
)
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Kimi K2 chat format (MODEL_FORMATS.md §1.6): role-name headers, <|im_middle|> before content,
# a default system turn when none is given, tool declarations first, tool results as system-ish turns.
# Assistant tool calls in Kimi's markup (written as text: this small vocabulary has no tool-call tokens), the
# call id ("functions.NAME:IDX") naming the result it gets back (jaxserve.server.toolcalls).
CHAT_TEMPLATE = r"""{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}
<|im_system|>system<|im_middle|>""" + DEFAULT_SYSTEM_PROMPT + r"""<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- if message['content'] is string -%}
{%- set content = message['content'] -%}
{%- elif message['content'] is none -%}
{%- set content = '' -%}
{%- else -%}
{%- set content = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}
{%- endif -%}
{%- if message['role'] == 'system' -%}
<|im_system|>system<|im_middle|>{{ content }}<|im_end|>
{%- elif message['role'] == 'user' -%}
<|im_user|>user<|im_middle|>{{ content }}<|im_end|>
{%- elif message['role'] == 'assistant' -%}
<|im_assistant|>assistant<|im_middle|>{{ content }}
{%- if message.get('tool_calls') -%}
<|tool_calls_section_begin|>
{%- for call in message['tool_calls'] -%}
<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>
{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}
<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- endif -%}
<|im_end|>
{%- elif message['role'] == 'tool' -%}
<|im_system|>{{ message.get('name') or 'tool' }}<|im_middle|>{{ '## Return of ' ~ message.get('tool_call_id', '') ~ '\n' }}{{ content }}<|im_end|>
{%- else -%}
{{ raise_exception('unknown message role: ' ~ message['role']) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}"""


@dataclass(frozen=True)
class TokenizerTrainConfig:
    """BPE training settings.

    vocab_size: int, total vocabulary including the special tokens.
    min_frequency: int, a pair must occur this often to be merged.
    special_tokens: tuple[str, ...], appended after the base vocabulary in this order.
    """

    vocab_size: int = 4096
    min_frequency: int = 2
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS

    def __post_init__(self) -> None:
        minimum = len(pre_tokenizers.ByteLevel.alphabet()) + len(self.special_tokens)
        if self.vocab_size <= minimum:
            raise ConfigError(f"vocab_size must exceed {minimum} (256 bytes + specials)", value=self.vocab_size, param="vocab_size")
        if EOS_TOKEN not in self.special_tokens:
            raise ConfigError(f"special_tokens must contain {EOS_TOKEN}", value=self.special_tokens, param="special_tokens")


def train(config: TokenizerTrainConfig, texts: list[str]) -> Tokenizer:
    """Train byte-level BPE on texts (in the given order) -> tokenizers.Tokenizer with specials appended."""
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: decode(encode(x)) must give x back byte for byte.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size - len(config.special_tokens),
        min_frequency=config.min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    base = tokenizer.get_vocab_size(with_added_tokens=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in config.special_tokens])
    if tokenizer.get_vocab_size(with_added_tokens=True) != config.vocab_size:
        raise ConfigError("corpus too small to reach the requested vocab size", value=base, param="vocab_size")
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer, config: TokenizerTrainConfig) -> dict:
    """HF-style tokenizer_config.json content -> dict (JSON-serialisable)."""
    decoder = {
        str(tokenizer.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
        for t in config.special_tokens
    }
    return {
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": None,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def save(tokenizer: Tokenizer, config: TokenizerTrainConfig, out_dir: Path, meta: dict) -> None:
    """Write tokenizer.json, tokenizer_config.json, generation_config.json, training_meta.json into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tokenizer, config), indent=2) + "\n")
    # Chat turns end in <|im_end|>, documents in <|endoftext|>: a server must stop on both.
    stop_ids = [tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id("<|im_end|>")]
    generation = {"bos_token_id": None, "eos_token_id": [i for i in stop_ids if i is not None]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out_dir / "training_meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """CLI entry: train on the train split and save into OUT_DIR."""
    parser = argparse.ArgumentParser(description="Train the tiny Kimi-style byte-level BPE tokenizer on stdlib sources.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args(argv)
    config = TokenizerTrainConfig(vocab_size=args.vocab_size)
    spec = corpus.default_spec()
    files = corpus.train_files(spec)
    texts = corpus.read_texts(files)
    start = time.perf_counter()
    tokenizer = train(config, texts)
    seconds = time.perf_counter() - start
    meta = {
        "vocab_size": config.vocab_size,
        "min_frequency": config.min_frequency,
        "train_files": len(files),
        "train_bytes": corpus.byte_count(files),
        "train_sha256": corpus.fingerprint(files, spec),
        "python": platform.python_version(),
        "tokenizers": tokenizers.__version__,
        "train_seconds": round(seconds, 2),
    }
    save(tokenizer, config, args.out_dir, meta)
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
