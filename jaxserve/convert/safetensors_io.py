"""A streaming reader for HF safetensors folders: one tensor at a time, memory-mapped, every dtype real checkpoints use.

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then data.
Reading it directly (rather than through a framework) gives NumPy arrays for bf16 and fp8 via ml_dtypes.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.errors import CheckpointError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    end: int


class SafetensorsFolder:
    """All tensors of an HF folder (sharded via model.safetensors.index.json, or single files)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted({self.folder / f for f in weight_map.values()})
            missing = [str(f) for f in files if not f.exists()]
            if missing:
                raise CheckpointError(f"shards named in {index.name} are missing: {missing}", value=missing,
                                      param="weight_map")
        if not files:
            raise CheckpointError(f"no .safetensors files in {self.folder}", value=str(self.folder), param="folder")
        self.tensors: dict[str, TensorInfo] = {}
        for f in files:
            self.tensors.update(_read_header(f))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint", value=name, param=name)
        return self.tensors[name]

    def read(self, name: str) -> np.ndarray:
        """The tensor as a NumPy array (a copy; the file stays mapped only while reading)."""
        t = self.info(name)
        if t.dtype not in DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}, which the converter cannot read "
                                  f"(readable: {', '.join(DTYPES)})", value=t.dtype, param=name)
        dt = DTYPES[t.dtype]
        count = int(np.prod(t.shape, dtype=np.int64))
        if t.end - t.start != count * dt.itemsize:
            raise CheckpointError(f"tensor {name!r}: {t.end - t.start} bytes for shape {t.shape} {t.dtype}",
                                  value=t.shape, param=name)
        mm = np.memmap(t.file, dtype=np.uint8, mode="r", offset=t.start, shape=(t.end - t.start,))
        return np.array(mm.view(dt).reshape(t.shape))


def _read_header(path: Path) -> dict[str, TensorInfo]:
    with open(path, "rb") as fh:
        raw_len = fh.read(8)
        if len(raw_len) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (too short)", value=str(path), param="file")
        (n,) = struct.unpack("<Q", raw_len)
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} has an unreadable safetensors header: {e}", value=str(path),
                                  param="file") from e
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        s, e = meta["data_offsets"]
        out[name] = TensorInfo(path, meta["dtype"], tuple(meta["shape"]), base + s, base + e)
    return out
