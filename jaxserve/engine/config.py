"""Engine configuration: formats per phase, pool sizes, batching limits, device layout."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxserve.errors import ConfigError

KVDtype = Literal["fp8", "bf16"]


@dataclass(frozen=True)
class EngineConfig:
    """Serving knobs. Prefill and decode each get their own weight format and KV dtype (the seeds' recipe:
    BF16 KV + FP8 weights in prefill, FP8 KV + INT4 weights in decode).

    attention: "xla" (gather + dense; the CPU default), "pallas" (GPU-shaped kernel), "pallas_tpu" (TPU-shaped MLA
    kernel), or either + "_interpret" (the same kernel on CPU).
    devices: how many devices to use (tensor parallel over heads and expert FFN); disaggregate: split them in
    two halves, prefill on the first, decode on the second, KV handed off BF16 -> FP8 between them.
    """

    kv_dtype: KVDtype = "fp8"
    prefill_weights: str = "fp8"
    decode_weights: str = "int4"
    int4_group_size: int = 32
    quantize_attention: bool = False
    use_kernels: bool = False  # Pallas matmul kernels for quantized weights
    integrity: bool = True
    attention: str = "xla"
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
    # smallest shape buckets: fewer distinct programs to compile, at the price of some padding
    min_rows_bucket: int = 4
    min_pages_bucket: int = 8
    min_chunk_bucket: int = 16

    def __post_init__(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise ConfigError(f"EngineConfig.{param} {msg}", value=getattr(self, param), param=param)

        if self.kv_dtype not in ("fp8", "bf16"):
            bad("kv_dtype", "must be 'fp8' or 'bf16'")
        for p in ("prefill_weights", "decode_weights"):
            if getattr(self, p) not in ("bf16", "f32", "fp8", "int4"):
                bad(p, "must be one of bf16, f32, fp8, int4")
        if self.attention not in ("xla", "pallas", "pallas_interpret", "pallas_tpu", "pallas_tpu_interpret"):
            bad("attention", "must be 'xla', 'pallas', 'pallas_tpu' or one of those + '_interpret'")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            bad("page_size", "must be a power of two")
        if self.prefill_chunk < 1 or self.prefill_chunk > self.max_prefill_tokens:
            bad("prefill_chunk", "must be in [1, max_prefill_tokens]")
        if self.max_batch < 1:
            bad("max_batch", "must be >= 1")
        if self.devices < 1 or (self.disaggregate and self.devices % 2):
            bad("devices", "must be >= 1 (and even when disaggregated)")
        if self.sharding not in ("tp", "ep", "dp_attention"):
            bad("sharding", "must be 'tp', 'ep' or 'dp_attention'")
        if self.expert_parallel and self.sharding == "tp":
            object.__setattr__(self, "sharding", "ep")
        if self.dtype not in ("bfloat16", "float32"):
            bad("dtype", "must be 'bfloat16' or 'float32'")

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    def buckets(self, floor: int, cap: int) -> list[int]:
        """The power-of-two shape buckets from `floor` up to `cap` (cap itself included)."""
        out, b = [], max(1, min(floor, cap))
        while b < cap:
            out.append(b)
            b *= 2
        return out + [cap]

    @property
    def row_buckets(self) -> list[int]:
        return self.buckets(self.min_rows_bucket, self.max_batch)

    @property
    def page_buckets(self) -> list[int]:
        return self.buckets(self.min_pages_bucket, self.max_pages_per_seq)

    @property
    def chunk_buckets(self) -> list[int]:
        return self.buckets(self.min_chunk_bucket, self.prefill_chunk)
