"""Engine configuration: formats per phase, pool sizes, batching limits, device layout."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from jaxserve.errors import ConfigError
from jaxserve.format_names import FORMATS, KV_DTYPES, KVDtype, canonical_format
from jaxserve.models.attention_backend import ATTENTION_NAMES, AttentionBackend
from jaxserve.models.paged_attention_xla import BLOCK_TOKENS

SPECULATIVE_METHODS = ("ngram", "mtp", "eagle3")
# running rows above which speculation turns itself off (plain overlapped decode): n-gram:3 on the embedded model,
# `bench/speculative.py --concurrency 1,2,4,8,16 --reps 3 --max-rows none` (bench/results/speculative_rows.json,
# load 7.4-8.3 on 2 shared cores): 1.73x, 1.32x, 1.54x, 1.03x, 0.98x of plain tokens/s at 1, 2, 4, 8, 16 rows
# (0.90x at 16 on a quiet host, load 1.3-1.6, bench/results/speculative_chain_quiet.json)
DEFAULT_MAX_ROWS = 8


@dataclass(frozen=True)
class Speculative:
    """Speculative decoding: each decode step drafts k tokens per row and verifies them in one target forward over
    k + 1 positions (engine.speculative). method: "ngram" (prompt lookup on the host, `engine.ngram`), "mtp" (the
    model's MTP head, on the device) or "eagle3" (an EAGLE-3 draft checkpoint at `path`, on the device,
    `engine.eagle3_programs`). max_rows: speculate only while at most this many rows run (decode or prefill), plain
    decode (overlapped) above (None: always; default DEFAULT_MAX_ROWS, where drafts stopped paying on this host)."""

    method: str
    k: int
    max_rows: int | None = DEFAULT_MAX_ROWS
    path: str | None = None  # the draft checkpoint folder (eagle3 only)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}",
                              value=self.method, param="speculative")
        if not isinstance(self.k, int) or not 1 <= self.k <= 16:
            raise ConfigError("speculative draft count k must be an integer in [1, 16]", value=self.k,
                              param="speculative")
        if self.max_rows is not None and (not isinstance(self.max_rows, int) or self.max_rows < 1):
            raise ConfigError("speculative max_rows must be None or an integer >= 1", value=self.max_rows,
                              param="speculative")
        if (self.method == "eagle3") != bool(self.path):
            raise ConfigError("speculative eagle3 needs a draft checkpoint path (eagle3:PATH:K), and only eagle3 takes "
                              "one", value=self.path, param="speculative")

    @classmethod
    def parse(cls, text: str) -> Speculative:
        """"ngram:3" / "mtp:3" (METHOD:K), or METHOD:K:MAX_ROWS, or "eagle3:PATH:K[:MAX_ROWS]" -> Speculative;
        anything else is a ConfigError naming it."""
        parts = text.split(":")
        if parts[0] == "eagle3" and len(parts) >= 3:  # the path may hold ':'; K and MAX_ROWS are the numeric tail
            tail = 2 if len(parts) >= 4 and parts[-1].isdigit() and parts[-2].isdigit() else 1
            path, nums = ":".join(parts[1:-tail]), parts[-tail:]
            if nums[0].isdigit():
                return cls("eagle3", int(nums[0]), int(nums[1]) if tail == 2 else DEFAULT_MAX_ROWS, path=path)
        if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts[1:]):
            raise ConfigError("speculative must be METHOD:K or METHOD:K:MAX_ROWS (eagle3:PATH:K[:MAX_ROWS]), "
                              "e.g. ngram:3 or ngram:3:8",
                              value=text, param="speculative")
        return cls(parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else DEFAULT_MAX_ROWS)


@dataclass(frozen=True)
class EngineConfig:
    """Serving knobs. Prefill and decode each get their own weight format and KV dtype (the seeds' recipe:
    BF16 KV + FP8 weights in prefill, FP8 KV + INT4 weights in decode).

    attention: "xla" (gather + dense; the CPU default), "pallas" (GPU-shaped kernel), "pallas_tpu" (TPU-shaped MLA
    kernel), or either + "_interpret" (the same kernel on CPU); `attention_backend` is it parsed, what the programs
    and the models read.
    devices: how many devices to use (tensor parallel over heads and expert FFN); disaggregate: split them in
    two halves, prefill on the first, decode on the second, KV handed off BF16 -> FP8 between them.
    """

    kv_dtype: KVDtype = "fp8"  # "f32": both pools f32 (reference precision for exactness tests)
    index_kv_dtype: KVDtype | None = None  # GLM-5 DSA indexer keys in the decode pool; None: as kv_dtype
    prefill_weights: str = "fp8"
    decode_weights: str = "int4"
    int4_group_size: int = 32
    int4_scope: str = "experts"  # "experts": routed experts only (Kimi's INT4 recipe); "mlps": every MLP projection
    quantize_attention: bool = False
    use_kernels: bool = False  # Pallas matmul kernels for quantized weights
    # "packed": quantized weights stay packed in memory and are dequantized inside each matmul (kernels, or XLA);
    # "compute": dequantized once at load into `dtype` (same values, more memory, no per-step unpack: for XLA on
    # CPU, which has no INT4/FP8 matmul); "auto": "compute" on CPU devices without Pallas, "packed" elsewhere
    weight_layout: Literal["auto", "packed", "compute"] = "auto"
    integrity: bool = True
    attention: str = "xla"
    attention_backend: AttentionBackend = field(init=False, repr=False, compare=False)  # `attention`, parsed
    page_size: int = 16
    num_decode_pages: int = 1024
    num_prefill_pages: int = 512
    max_batch: int = 32  # decode rows per step
    max_prefill_tokens: int = 512  # prompt tokens per step, all rows together
    prefill_chunk: int = 256  # prompt tokens of one request per step
    max_model_len: int = 2048
    max_queue: int = 1024
    prefix_cache: bool = True
    devices: int = 1
    first_device: int = 0  # this engine uses jax.devices()[first_device : first_device + devices] (replicas)
    disaggregate: bool = False
    expert_parallel: bool = False  # shorthand for sharding="ep"
    # how each phase's devices are used (jaxserve.sharding presets): "tp" tensor parallel (heads, FFN, vocab),
    # "ep" experts whole per device, "dp_attention" attention data-parallel over requests + experts split
    sharding: str = "tp"
    dtype: str = "bfloat16"
    # smallest shape buckets: fewer distinct programs to compile, at the price of some padding (see `buckets`)
    min_rows_bucket: int = 1
    min_pages_bucket: int = 8
    min_chunk_bucket: int = 16
    # decode page buckets per doubling: 1 = powers of two (up to 2x padding), 2 = also 1.5x powers of two (<= 1.33x)
    page_bucket_steps: int = 2
    # dispatch decode step N+1 before reading step N's tokens (engine.scheduler "Overlap"); False: one step at a time
    overlap: bool = True
    # batch-invariant outputs: a greedy or seeded request's tokens do not depend on what shares its batch. The
    # programs keep their buckets and compute rows in fixed-shape tiles (engine.invariant; the smallest page bucket
    # is one attention block); with speculative decoding or DP attention every program runs at one shape instead
    # (rows = max_batch, block table = the longest sequence, chunk = prefill_chunk). A request is admitted only when
    # the decode pool can hold it to its last token, so nothing is ever preempted (a recompute runs prefill's path
    # and changes the tokens). Off by default: a lone stream pays 45% and the no-preemption admission about halves
    # the chats decoding at once (README). None: on where the tiles apply, off with speculative decoding or DP
    # attention, where it would pin every shape
    deterministic: bool | None = False
    # which phases this engine runs (`jaxserve serve --role`): "both" (one process, hand-off inside), "prefill"
    # (prefill pool and weights only; exports finished prompts' pages over the KV transfer service), "decode"
    # (decode pool and weights only; pulls its requests' pages from a prefill server), see PD_PROTOCOL.md
    role: Literal["both", "prefill", "decode"] = "both"
    transfer_host: str = "127.0.0.1"  # prefill role: where the KV transfer service listens (port 0: a free one)
    transfer_port: int = 0
    transfer_timeout_s: float = 30.0  # an export not pulled by then is dropped; a pull's socket timeout
    max_transfers: int = 64  # exports held at once (more: the request fails with KVTransferError)
    # draft k tokens per decode step and verify them in one forward (Speculative, or its "ngram:3" text); None: off
    speculative: Speculative | None = None
    # memory mappings the process may hold before compiled programs are dropped to the persistent compile cache, in
    # the full warm-up and between steps after it (engine.warmup); None: half of vm.max_map_count
    max_maps: int | None = None

    def __post_init__(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise ConfigError(f"EngineConfig.{param} {msg}", value=getattr(self, param), param=param)

        # accept the dtype names users type ("bfloat16", "float8_e4m3fn", ...)
        for p in ("kv_dtype", "index_kv_dtype", "prefill_weights", "decode_weights"):
            object.__setattr__(self, p, canonical_format(getattr(self, p)))
        object.__setattr__(self, "dtype", {"bf16": "bfloat16", "f32": "float32", "fp32": "float32"}.get(
            self.dtype, self.dtype))

        if self.kv_dtype not in KV_DTYPES:
            bad("kv_dtype", f"must be one of {', '.join(KV_DTYPES)}")
        if self.index_kv_dtype not in (None, "bf16", self.kv_dtype):
            bad("index_kv_dtype", "must be None, 'bf16' or kv_dtype (FP8 keys need an FP8 pool)")
        for p in ("prefill_weights", "decode_weights"):
            if getattr(self, p) not in FORMATS:
                bad(p, f"must be one of {', '.join(FORMATS)}")
        if self.weight_layout not in ("auto", "packed", "compute"):
            bad("weight_layout", "must be 'auto', 'packed' or 'compute'")
        if self.attention not in ATTENTION_NAMES:
            bad("attention", "must be 'xla', 'pallas', 'pallas_tpu' or one of those + '_interpret'")
        object.__setattr__(self, "attention_backend", AttentionBackend.parse(self.attention))
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            bad("page_size", "must be a power of two")
        if self.prefill_chunk < 1 or self.prefill_chunk > self.max_prefill_tokens:
            bad("prefill_chunk", "must be in [1, max_prefill_tokens]")
        if self.max_batch < 1:
            bad("max_batch", "must be >= 1")
        if self.devices < 1 or (self.disaggregate and self.devices % 2):
            bad("devices", "must be >= 1 (and even when disaggregated)")
        if self.role not in ("both", "prefill", "decode") or self.role != "both" and self.disaggregate:
            bad("role", "must be 'both', 'prefill' or 'decode' (disaggregate only with 'both')")
        if self.sharding not in ("tp", "ep", "dp_attention"):
            bad("sharding", "must be 'tp', 'ep' or 'dp_attention'")
        if self.expert_parallel and self.sharding == "tp":
            object.__setattr__(self, "sharding", "ep")
        if self.dtype not in ("bfloat16", "float32"):
            bad("dtype", "must be 'bfloat16' or 'float32'")
        if isinstance(self.speculative, str):
            object.__setattr__(self, "speculative", Speculative.parse(self.speculative))
        if self.speculative is not None and self.speculative.method in ("mtp", "eagle3") and self.role != "both":
            bad("speculative", f"{self.speculative.method} drafts need the prefill program's draft pass: --role both "
                "only (ngram works)")
        if self.page_bucket_steps not in (1, 2):
            bad("page_bucket_steps", "must be 1 (powers of two) or 2 (half octaves)")
        for p in ("min_rows_bucket", "min_pages_bucket", "min_chunk_bucket"):
            if getattr(self, p) < 1:
                bad(p, "must be >= 1")
        if self.deterministic is None:
            object.__setattr__(self, "deterministic", self.speculative is None and self.dp_ranks == 1)
        if self.deterministic and not self.invariant_tiles:
            for p, v in (("min_rows_bucket", self.max_batch), ("min_pages_bucket", self.max_pages_per_seq),
                         ("min_chunk_bucket", self.prefill_chunk)):
                object.__setattr__(self, p, v)
        elif self.deterministic:  # decode attention's key block follows the table width below one block
            object.__setattr__(self, "min_pages_bucket", max(self.min_pages_bucket, min(
                self.max_pages_per_seq, -(-BLOCK_TOKENS // self.page_size))))
        # DP attention: each rank holds its own rows and page range, so rows and pools split evenly over ranks
        for p in ("max_batch", "num_decode_pages", "num_prefill_pages"):
            if getattr(self, p) % self.dp_ranks:
                bad(p, f"must divide by the {self.dp_ranks} data-parallel attention ranks")

    @property
    def dp_ranks(self) -> int:
        """Data-parallel attention ranks per phase: each phase's device count under sharding="dp_attention", else 1."""
        if self.sharding != "dp_attention":
            return 1
        return self.devices // 2 if self.disaggregate else self.devices

    @property
    def invariant_tiles(self) -> bool:
        """Deterministic serving by fixed-shape tiles inside normal buckets (engine.invariant); speculative decoding
        and DP attention pin every bucket to one shape instead."""
        return self.deterministic and self.speculative is None and self.dp_ranks == 1

    @property
    def phases(self) -> tuple[str, ...]:
        """The phases this engine builds: ("prefill", "decode") for role "both", else the role's own."""
        return ("prefill", "decode") if self.role == "both" else (self.role,)

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    def buckets(self, floor: int, cap: int, steps: int = 1) -> list[int]:
        """Shape buckets from `floor` up to `cap` (cap itself included): powers of two, and with steps=2 also
        3 * 2^k between them (8, 12, 16, 24, 32, ...)."""
        out, b = [], max(1, min(floor, cap))
        while b < cap:
            out.append(b)
            half = b + b // 2
            if steps == 2 and b >= 2 and half < cap and b & (b - 1) == 0:
                out.append(half)
            b = 1 << b.bit_length() if b & (b - 1) else b * 2
        return sorted(set(out + [cap]))

    @staticmethod
    def pick(buckets: list[int], n: int) -> int:
        """The smallest bucket >= n (the largest when n exceeds them all)."""
        return next((b for b in buckets if b >= n), buckets[-1])

    @property
    def row_buckets(self) -> list[int]:
        """Batch rows of decode and prefill programs: 1, 2, 4, ... max_batch (under DP attention, those per rank
        times the ranks: every rank gets the same number of rows)."""
        r = self.dp_ranks
        return [r * b for b in self.buckets(self.min_rows_bucket, self.max_batch // r)]

    @property
    def page_buckets(self) -> list[int]:
        """Block-table widths of decode programs (attention reads this many pages per row)."""
        return self.buckets(self.min_pages_bucket, self.max_pages_per_seq, self.page_bucket_steps)

    @property
    def prefill_page_buckets(self) -> list[int]:
        """Block-table widths of prefill programs and hand-off sizes: powers of two (prefill is compute-bound on
        its chunk, so coarser context buckets cost little and keep the prefill grid small)."""
        return self.buckets(self.min_pages_bucket, self.max_pages_per_seq)

    @property
    def chunk_buckets(self) -> list[int]:
        return self.buckets(self.min_chunk_bucket, self.prefill_chunk)

    @property
    def prefill_slots(self) -> int:
        """Padded token slots (rows x chunk bucket) one prefill step may compute: the scheduler stops adding rows
        past it, so only (rows, chunk) pairs within it (or a single row) ever compile. With pinned buckets
        (`deterministic`) every prefill computes the smallest program's slots whatever it holds: those are free."""
        return max(self.max_prefill_tokens, self.row_buckets[0] * self.chunk_buckets[0])

    @property
    def prefill_shapes(self) -> list[tuple[int, int]]:
        """(rows, chunk tokens) bucket pairs a prefill step can have."""
        return [(b, t) for t in self.chunk_buckets for b in self.row_buckets if b == 1 or b * t <= self.prefill_slots]

    def program_count(self) -> dict[str, int]:
        """How many programs the full bucket grid holds (what `Programs.warmup` compiles; a greedy batch uses the
        greedy sampling program, and each sampling mode a batch uses compiles its own program on first use).

        Default config (max_batch 32, 128 pages per sequence, chunks 16..256, 512 prefill tokens): decode 6 x 9
        = 54, prefill 20 x 5 = 100, hand-off 5."""
        out = {"decode": len(self.row_buckets) * len(self.page_buckets),
               "prefill": len(self.prefill_shapes) * len(self.prefill_page_buckets),
               "handoff": len(self.prefill_page_buckets)}
        if self.speculative is not None:  # the verify program: decode's grid, k + 1 positions per row
            out["verify"] = out["decode"]
        return out
