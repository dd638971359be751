"""A streaming safetensors reader and writer: one tensor in memory at a time.

`safetensors.torch.save_file` needs every tensor of a file in memory at once. The quantizer
knows the dtype and shape of every output tensor before it quantizes anything (they follow
from the source header), so it writes the header first and then streams the data, tensor by
tensor: peak memory is bounded by the largest tensor, not by the shard or the model.

Reading: every header is checked twice. First here, field by field (8-byte little-endian
length, JSON object, each entry a {"dtype", "shape", "data_offsets"} object of the right
types, contiguous offsets inside the file, a dict of strings as __metadata__), so that any
malformed header, shape, dtype, offset or truncation raises `CheckpointError` naming the file
and the tensor at fault, and nothing is allocated beyond what the file holds (a tensor's
bytes must lie inside the file before it is read). Then by the safetensors library itself
(`safe_open`, which parses the header without reading the data), so that a file the library
(and therefore vLLM) would refuse is refused here too, with its message and the file name.

The library cannot be the only reader: it exposes neither the data offsets nor the raw bytes
of a tensor, and the streaming copy of kept tensors (`StreamingWriter.copy_from`) moves them
byte for byte, in bounded chunks, whatever their dtype (also dtypes torch cannot hold, e.g.
F4); its messages also do not always name the tensor. Writing cannot use it either:
`save_file` needs all tensors of a shard in memory at once.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

import torch
from safetensors import safe_open

from vllm_mxplus.checkpoint.errors import CheckpointError, write_failure

HEADER_LEN_BYTES = 8
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit (100 MB)
ALIGN = 8  # data section starts 8-byte aligned, as safetensors writes it
COPY_CHUNK = 64 * 1024 * 1024  # bytes per read/write when copying a kept tensor

# safetensors dtype string -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype | None, int]] = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "I16": (torch.int16, 2),
    "U16": (torch.uint16, 2),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I32": (torch.int32, 4),
    "U32": (torch.uint32, 4),
    "F32": (torch.float32, 4),
    "I64": (torch.int64, 8),
    "U64": (torch.uint64, 8),
    "F64": (torch.float64, 8),
}
TORCH_TO_ST = {dt: name for name, (dt, _) in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: where its bytes are and what they hold."""

    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    path: Path
    begin: int  # absolute file offsets of the data
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return DTYPES[self.dtype][0]


def read_header(path: Path) -> tuple[list[TensorInfo], dict[str, str]]:
    """The tensors of a safetensors file in data order, and its __metadata__.

    Validates everything the data section depends on (dtypes, sizes, contiguous offsets,
    file length), so later reads cannot run past the end of a truncated file; then lets the
    safetensors library check the header by its own rules (module docstring).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(HEADER_LEN_BYTES)
            if len(raw_len) < HEADER_LEN_BYTES:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", raw_len)
            if n > MAX_HEADER_BYTES or HEADER_LEN_BYTES + n > size:
                raise CheckpointError(
                    f"{path}: corrupted or truncated safetensors file "
                    f"(header length {n} does not fit in {size} bytes)"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) != n:
        raise CheckpointError(f"{path}: truncated safetensors header ({len(raw)} of {n} bytes)")
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # RecursionError: deeply nested JSON ([[[[...) exhausts the parser's stack
        raise CheckpointError(f"{path}: corrupted safetensors header ({e})") from None
    metadata = _metadata(path, header.pop("__metadata__", None))
    data_start = HEADER_LEN_BYTES + n
    infos = [_tensor_info(path, name, entry, data_start) for name, entry in header.items()]
    infos.sort(key=lambda t: (t.begin, t.end))
    expected, before = data_start, "the start of the data"
    for t in infos:
        if t.begin != expected:
            raise CheckpointError(
                f"{path}: corrupted safetensors file: tensor {t.name!r} data offsets "
                f"[{t.begin - data_start}, {t.end - data_start}] "
                f"{'overlap' if t.begin < expected else 'leave a gap after'} {before}"
            )
        expected, before = t.end, f"tensor {t.name!r}"
    if expected > size:
        last = infos[-1].name if infos else "?"
        raise CheckpointError(
            f"{path}: truncated safetensors file: tensor {last!r} ends at byte {expected}, "
            f"the file has {size} bytes"
        )
    _library_check(path)
    return infos, metadata


def _library_check(path: Path) -> None:
    """The safetensors library's own header validation (mmap, no data read)."""
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as e:  # SafetensorError, OSError, ...: any refusal is a bad file
        raise CheckpointError(
            f"{path}: the safetensors library refuses this file ({e}); re-create or re-download it"
        ) from None


def _metadata(path: Path, meta: object) -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CheckpointError(
            f"{path}: corrupted safetensors header: __metadata__ must map strings to strings"
        )
    return meta


def _is_index(x: object) -> bool:
    """A JSON integer >= 0 (not a bool, not a float such as 2.0 or 1e999)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _tensor_info(path: Path, name: str, entry: object, data_start: int) -> TensorInfo:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(
            f"{path}: corrupted safetensors header entry for tensor {name!r}: {what}"
        )

    if not isinstance(entry, dict):
        raise bad(f"expected an object, got {type(entry).__name__}")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise bad(f"no {', '.join(repr(k) for k in missing)} (keys: {sorted(entry)})")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise bad(f"dtype {dtype!r} is not a string")
    if dtype not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype[:40]!r}")
    if not isinstance(shape, list) or not all(_is_index(d) for d in shape):
        raise bad(f"shape {str(shape)[:80]} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_index, offsets))):
        raise bad(f"data_offsets {str(offsets)[:80]} is not [begin, end] (integers >= 0)")
    begin, end = offsets
    if end < begin or end - begin != math.prod(shape) * DTYPES[dtype][1]:
        raise CheckpointError(
            f"{path}: corrupted safetensors header: tensor {name!r} {dtype}{str(shape)[:80]} "
            f"does not match its data_offsets [{begin}, {end}]"
        )
    return TensorInfo(name, dtype, tuple(shape), path, data_start + begin, data_start + end)


def read_tensor(info: TensorInfo, f: BinaryIO | None = None) -> torch.Tensor:
    """Load one tensor into CPU memory (one copy, no mmap)."""
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    dtype = info.torch_dtype
    if dtype is None:
        raise CheckpointError(
            f"{info.path}: tensor {info.name!r} has unsupported dtype {info.dtype}"
        )
    fh: BinaryIO | None = f
    try:
        if f is None:
            fh = open(info.path, "rb")  # noqa: SIM115  (closed in finally)
        assert fh is not None
        fh.seek(info.begin)
        got = cast(io.BufferedIOBase, fh).readinto(buf.numpy().data) if info.nbytes else 0
    except OSError as e:
        raise CheckpointError(f"{info.path}: cannot read tensor {info.name!r} ({e})") from None
    finally:
        if f is None and fh is not None:
            fh.close()
    if got != info.nbytes:
        raise CheckpointError(f"{info.path}: truncated data for tensor {info.name!r}")
    return buf.view(dtype).reshape(info.shape)


@dataclass(frozen=True)
class PlannedTensor:
    """An output tensor announced in a header before its data is written."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


class StreamingWriter:
    """Writes one safetensors file whose tensors are known in advance, in that order.

    `write(name, tensor)` must be called once per planned tensor, in plan order; the dtype and
    shape are checked against the plan. `close()` checks that every tensor was written.
    """

    def __init__(self, path: Path, plan: Iterable[PlannedTensor], metadata: dict[str, str]):
        self.path = Path(path)
        self.plan = list(plan)
        self._next = 0
        header: dict[str, object] = {"__metadata__": dict(metadata)}
        offset = 0
        for t in self.plan:
            header[t.name] = {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-(HEADER_LEN_BYTES + len(raw)) % ALIGN)
        try:
            self._f = open(self.path, "wb")  # noqa: SIM115  (closed by close())
            self._f.write(struct.pack("<Q", len(raw)))
            self._f.write(raw)
        except OSError as e:
            self.abort()
            raise write_failure(self.path, e, "write the safetensors header") from None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.plan) or self.plan[self._next].name != name:
            want = self.plan[self._next].name if self._next < len(self.plan) else None
            raise CheckpointError(f"{self.path}: wrote {name!r}, the plan expects {want!r}")
        p = self.plan[self._next]
        got = (TORCH_TO_ST.get(tensor.dtype), tuple(tensor.shape))
        if got != (p.dtype, p.shape):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} is {got[0]}{list(got[1])}, "
                f"planned {p.dtype}{list(p.shape)}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        try:
            self._f.write(data.numpy().data)
        except OSError as e:
            raise write_failure(self.path, e, f"write tensor {name!r}") from None
        self._next += 1

    def copy_from(self, info: TensorInfo, src: BinaryIO) -> None:
        """Copy a kept tensor's bytes straight from the source file (any dtype, no torch)."""
        p = self.plan[self._next] if self._next < len(self.plan) else None
        if p is None or (p.name, p.dtype, p.shape) != (info.name, info.dtype, info.shape):
            raise CheckpointError(f"{self.path}: copy of {info.name!r} does not match the plan")
        src.seek(info.begin)
        left = info.nbytes
        while left:
            chunk = src.read(min(left, COPY_CHUNK))
            if not chunk:
                raise CheckpointError(f"{info.path}: truncated data for tensor {info.name!r}")
            try:
                self._f.write(chunk)
            except OSError as e:
                raise write_failure(self.path, e, f"write tensor {info.name!r}") from None
            left -= len(chunk)
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.plan):
            self.abort()
            raise CheckpointError(
                f"{self.path}: {len(self.plan) - self._next} planned tensors were not written"
            )
        try:  # buffered bytes reach the disk here: a full disk may only show now
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        except OSError as e:
            self.abort()
            raise write_failure(self.path, e) from None

    def abort(self) -> None:
        f = getattr(self, "_f", None)
        if f is not None:
            # closing flushes: a full disk fails again, and that is already reported
            with contextlib.suppress(OSError):
                f.close()
