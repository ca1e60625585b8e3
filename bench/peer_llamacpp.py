"""llama.cpp as a CPU peer: the HF folder exported to GGUF by llama.cpp's own converter, greedy generation of
several sequences in one batch through llama-cpp-python's low-level API.

Optional: `make peers` installs llama-cpp-python (built from source) and unpacks the converter that ships in its
source distribution under .cache/peers/. Without them `status()` says what is missing and the bench skips this side.

Concurrency: the high-level `Llama` class decodes one sequence, so this drives llama.cpp's C API directly: one
context with n_seq_max = concurrency, every prompt prefilled in one llama_batch (each row its own seq_id), then one
batch per step with one token per row; greedy = argmax of each row's logits (first index on ties, as torch).
"""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.3.36"  # the pyproject "peers" extra pins this; the converter must come from the same release
CONVERTER = ROOT / ".cache" / "peers" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"

# The converter identifies a BPE pre-tokenizer by hashing its output on a fixed text and knows only published
# tokenizers; the embedded tokenizer is byte-level BPE with the GPT-2 split regex, which llama.cpp calls "gpt-2".
# The shim runs the shipped script unchanged with that one answer given (the bench feeds token ids, not text).
_SHIM = """
import runpy, sys
script = sys.argv[1]
sys.path.insert(0, str(__import__('pathlib').Path(script).parent))
sys.argv = [script] + sys.argv[2:]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
runpy.run_path(script, run_name="__main__")
"""


def status(converter: Path = CONVERTER) -> str:
    """"ok", or what is missing (the JSON and the table record it)."""
    try:
        import llama_cpp
    except ImportError:
        return "not installed (llama-cpp-python; `make peers`)"
    if llama_cpp.__version__ != VERSION:
        return f"llama-cpp-python {llama_cpp.__version__} installed, the bench pins {VERSION} (`make peers`)"
    if not converter.exists():
        return f"not installed (converter {converter} absent; `make peers`)"
    return "ok"


def export_gguf(hf_dir: Path, out: Path, converter: Path = CONVERTER) -> Path:
    """HF folder -> f32 GGUF file (llama.cpp's `deepseek2` architecture for DeepseekV3) by the shipped converter."""
    cmd = [sys.executable, "-c", _SHIM, str(converter), str(hf_dir), "--outtype", "f32", "--outfile", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"GGUF conversion failed ({' '.join(cmd[3:])}):\n{done.stderr[-3000:]}")
    return out


@dataclass(frozen=True)
class LlamaCppConfig:
    """rows: sequences decoded together (n_seq_max); context: tokens per sequence (prompt + new tokens);
    threads: n_threads and n_threads_batch (decode and prefill)."""

    rows: int
    context: int
    threads: int


class LlamaCpp:
    """One llama.cpp model and context sized for `cfg`: generate() runs `rows` greedy sequences in lock step."""

    def __init__(self, gguf: Path, cfg: LlamaCppConfig) -> None:
        import llama_cpp as lc

        self.lc, self.cfg = lc, cfg
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # errors only: the loader logs every tensor otherwise
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cp = lc.llama_context_default_params()
        # n_ctx is the whole cache across sequences; each sequence gets n_ctx / n_seq_max (non-unified cache)
        cp.n_ctx = cfg.rows * cfg.context
        cp.n_batch = cp.n_ubatch = max(cfg.rows * cfg.context, 512)  # a whole prefill in one ubatch
        cp.n_seq_max = cfg.rows
        cp.n_threads = cp.n_threads_batch = cfg.threads
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {cfg}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(cp.n_batch, 0, cfg.rows)
        self.params = {"n_ctx": lc.llama_n_ctx(self.ctx), "n_ctx_seq": lc.llama_n_ctx_seq(self.ctx), "n_batch": cp.n_batch, "n_seq_max": cp.n_seq_max,
                       "n_threads": cp.n_threads, "n_threads_batch": cp.n_threads_batch, "type_k": cp.type_k,
                       "type_v": cp.type_v, "flash_attn_type": cp.flash_attn_type,
                       "system_info": lc.llama_print_system_info().decode().strip()}

    def _decode(self, tokens: np.ndarray, pos: np.ndarray, seq: np.ndarray, want: np.ndarray) -> np.ndarray:
        """One llama_decode over len(tokens) entries -> greedy next token of each entry with want=True, in order."""
        b, n = self.batch, len(tokens)
        for field, values in (("token", tokens), ("pos", pos), ("n_seq_id", np.ones(n)), ("logits", want)):
            np.ctypeslib.as_array(getattr(b, field), shape=(n,))[:] = values  # views of the C arrays
        for i in range(n):  # seq_id is an array of per-entry arrays
            b.seq_id[i][0] = int(seq[i])
        b.n_tokens = n
        if (rc := self.lc.llama_decode(self.ctx, b)) != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {n} tokens")
        out = []
        for i in np.flatnonzero(want):
            logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, int(i)), shape=(self.n_vocab,))
            out.append(int(np.argmax(logits)))
        return np.array(out, np.int64)

    def generate(self, prompts: np.ndarray, new_tokens: int) -> tuple[float, np.ndarray]:
        """prompts [rows, prompt_len] int -> (wall seconds, greedy tokens [rows, new_tokens]); prefill included,
        exactly new_tokens per row (no end-of-sequence check); the cache is cleared first."""
        rows, plen = prompts.shape
        if rows > self.cfg.rows or plen + new_tokens > self.cfg.context:
            raise ValueError(f"llama.cpp context sized for {self.cfg}, asked {rows} rows of {plen}+{new_tokens}")
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        seq = np.repeat(np.arange(rows), plen)
        want = np.tile(np.arange(plen) == plen - 1, rows)
        out = np.empty((rows, new_tokens), np.int64)
        out[:, 0] = self._decode(prompts.reshape(-1), np.tile(np.arange(plen), rows), seq, want)
        ids, every = np.arange(rows), np.ones(rows, bool)
        for t in range(1, new_tokens):
            out[:, t] = self._decode(out[:, t - 1], np.full(rows, plen + t - 1), ids, every)
        return time.perf_counter() - t0, out

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

