"""Fuzzing the checkpoint readers with mutated checkpoints (seeded, a few seconds).

Every mutation of a quantized checkpoint (`open_checkpoint` + loading every tensor) and of a
source model dir (`open_source` + `read_tensor` of every tensor) must either load or raise
`CheckpointError` whose message names a file of the checkpoint (and, for a damaged header
entry, a tensor); any other exception fails with the seed and the mutation to replay it.
The stream reader may never allocate more bytes for a tensor than its file holds.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_custom

from vllm_mxplus.checkpoint import CheckpointError, open_checkpoint, quantize_checkpoint
from vllm_mxplus.checkpoint import safetensors_io as st_io
from vllm_mxplus.checkpoint.source import open_source

SHARD = "model.safetensors"
CASES_PER_SEED = 500  # x 4 seeds x 2 targets: 4,000 mutated checkpoints
SEEDS = range(4)
DEEP = "[" * 100_000  # nesting that exhausts a recursive JSON parser
JUNK: list[object] = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    2.0,
    2**63,
    2**70,
    -(2**63),
    1e308,
    "",
    "x",
    "BF16",
    "F8_E8M0",
    "F4",
    [],
    {},
    [1],
    [-1],
    [1, 2, 3],
    [[1, 2]],
    [0, 2**64],
    ["1", "2"],
    [True, 1],
    [1.5, 2],
    {"shape": [1]},
]


def _split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(header: object, data: bytes, *, pad: bool = True) -> bytes:
    text = json.dumps(header, separators=(",", ":"))
    raw = text.encode()
    if pad:
        raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def _damage_key(rng: random.Random, key: str) -> str:
    i = rng.randrange(len(key))
    return key[:i] + rng.choice(["", "_", key[i].upper(), "\u00e9", key[i] * 2]) + key[i + 1 :]


def _mutate_entry(rng: random.Random, entry: dict) -> str:
    """Damage one field of a tensor's header entry; returns what was done."""
    key = rng.choice(["dtype", "shape", "data_offsets"])
    op = rng.randrange(6)
    if key not in entry:
        entry[key] = rng.choice(JUNK)
        return f"{key} added = {entry[key]!r:.40}"
    if op == 0:
        del entry[key]
        return f"{key} deleted"
    if op == 1:
        entry[_damage_key(rng, key)] = entry.pop(key)
        return f"{key} key damaged"
    if op == 2:
        entry[key] = rng.choice(JUNK)
        return f"{key} = {entry[key]!r:.40}"
    if key == "dtype":
        entry[key] = rng.choice(list(st_io.DTYPES) + ["F4", "C64", "bf16", "F8_E8M0"])
        return f"dtype = {entry[key]}"
    v = entry[key]
    if not isinstance(v, list) or not v:
        return "nothing"
    i = rng.randrange(len(v))
    if op == 3:
        v[i] = rng.choice([v[i] + 1, v[i] - 1, v[i] * 2, -v[i], 0, 2**62, v[i] + 2**63])
    elif op == 4:
        v[i] = rng.choice(JUNK)
    else:
        rng.shuffle(v) if rng.random() < 0.5 else v.append(rng.choice([0, 1, 16]))
    return f"{key} -> {v!r:.60}"


def _mutate_metadata(rng: random.Random, meta: dict) -> str:
    key = rng.choice(sorted(meta))
    op = rng.randrange(4)
    if op == 0:
        del meta[key]
        return f"__metadata__.{key} deleted"
    if op == 1:
        meta[key] = rng.choice(JUNK)
        return f"__metadata__.{key} = {meta[key]!r:.40}"
    text = meta[key]
    try:
        rec = json.loads(text)
    except ValueError:
        rec = None
    if op == 2 and isinstance(rec, dict) and rec:  # damage one recorded weight
        mod = rng.choice(sorted(rec))
        if isinstance(rec[mod], dict) and rec[mod]:
            what = _mutate_entry(rng, rec[mod]) if rng.random() < 0.3 else ""
            k = rng.choice(sorted(rec[mod]))
            rec[mod][_damage_key(rng, k) if rng.random() < 0.5 else k] = rng.choice(JUNK)
            meta[key] = json.dumps(rec)
            return f"__metadata__.{key}[{mod}] damaged {what}"
    i = rng.randrange(len(text) + 1)
    meta[key] = text[:i] + rng.choice(["", "}", "{", '"', "[", "1e999", DEEP[:50]]) + text[i:]
    return f"__metadata__.{key} text damaged at {i}"


def mutate_shard(rng: random.Random, raw: bytes) -> tuple[bytes, str, str | None]:
    """(new bytes, description, name of the damaged tensor or None)."""
    header, data = _split(raw)
    names = [k for k in header if k != "__metadata__"]
    op = rng.randrange(10)
    if op == 0:  # raw bytes of the header (or its length)
        b = bytearray(raw)
        n = 8 + struct.unpack("<Q", raw[:8])[0]
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(n)] = rng.randrange(256)
        return bytes(b), "header bytes flipped", None
    if op == 1:  # truncation anywhere
        cut = rng.randrange(len(raw))
        return raw[:cut], f"truncated to {cut} bytes", None
    if op == 2:  # bytes appended or removed at the end of the data
        if rng.random() < 0.5:
            return raw + bytes(rng.randint(1, 64)), "trailing bytes", None
        return raw[: -rng.randint(1, 8)], "short data", None
    if op == 3:  # header JSON replaced by something that is not a header object
        junk = rng.choice([[], "x", 1, None, DEEP, {"a": DEEP}])
        return _join(junk, data) if junk is not DEEP else _raw_header(DEEP, data), "junk", None
    if op == 4:  # header length prefix lies
        (n,) = struct.unpack("<Q", raw[:8])
        n2 = rng.choice([0, 1, n - 1, n + 1, n + 8, len(raw), 2**63, 2**64 - 1])
        return struct.pack("<Q", n2) + raw[8:], f"header length {n2}", None
    if op == 5 and "__metadata__" in header:
        what = _mutate_metadata(rng, header["__metadata__"])
        return _join(header, data), what, None
    if op == 6:  # a whole entry removed, duplicated under another name, or replaced
        name = rng.choice(names)
        if rng.random() < 0.5:
            header[f"{name}.extra"] = dict(header[name])
            return _join(header, data), f"{name} duplicated", f"{name}.extra"
        header[name] = rng.choice(JUNK)
        return _join(header, data), f"{name} entry = junk", name
    if op == 7:  # the header without its alignment padding / data shifted by a byte
        return _join(header, data[1:], pad=rng.random() < 0.5), "data shifted", None
    name = rng.choice(names)
    what = _mutate_entry(rng, header[name])
    return _join(header, data), f"{name}: {what}", name


def _raw_header(text: str, data: bytes) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw + data


def mutate_config(rng: random.Random, cfg: dict) -> str:
    q = cfg["quantization_config"]
    key = rng.choice(sorted(q))
    op = rng.randrange(3)
    if op == 0:
        del q[key]
    elif op == 1:
        q[key] = rng.choice(JUNK + ["mxfp4-ocp", "nvfp4", "mxfp4-mbs-d", 16, 32, 48, 129])
    else:
        cfg["quantization_config"] = rng.choice(JUNK)
        return f"quantization_config = {cfg['quantization_config']!r:.40}"
    return f"quantization_config.{key} {'deleted' if op == 0 else '= ' + repr(q[key])[:40]}"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A source dir (bf16 linears + an fp32 norm) and its mxfp4-mbs-s checkpoint."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "l.0.proj.weight": torch.randn(16, 256, generator=g).bfloat16(),
        "l.1.proj.weight": torch.randn(8, 144, generator=g).bfloat16(),
        "norm.weight": torch.randn(64, generator=g),
        "step": torch.tensor([3], dtype=torch.int64),
    }
    root = tmp_path_factory.mktemp("fuzz")
    src = make_custom(root / "src", tensors)
    dst = root / "q"
    quantize_checkpoint(src, dst, "mxfp4-mbs-s", progress=False, device="cpu")
    return src, dst


def _guard_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """read_tensor may not allocate more bytes than the tensor's file holds."""
    real = st_io.read_tensor

    def guarded(info: st_io.TensorInfo, f=None):  # noqa: ANN001, ANN202
        size = info.path.stat().st_size
        assert 0 <= info.begin <= info.end <= size, (info, size)
        return real(info, f)

    monkeypatch.setattr(st_io, "read_tensor", guarded)


def _check(run: Callable[[], object], case: str, files: list[str], tensor: str | None) -> str:
    """'ok' or 'error'; fails on any exception but CheckpointError or a vague message."""
    try:
        run()
    except CheckpointError as e:
        msg = str(e)
        assert "\n" not in msg, f"{case}: multi-line message {msg!r}"
        assert any(f in msg for f in files), f"{case}: message names no file: {msg!r}"
        if tensor is not None and "header entry" in msg:
            assert repr(tensor) in msg, f"{case}: message does not name {tensor!r}: {msg!r}"
        return "error"
    except Exception as e:  # noqa: BLE001  the point of the test
        pytest.fail(f"{case}: {type(e).__name__}: {e!s:.300}")
    return "ok"


def _load_quantized(dst: Path) -> None:
    ck = open_checkpoint(dst)
    ck.quantized()
    ck.unquantized()


def _load_source(src: Path) -> None:
    s = open_source(src)
    with open(s.tensors[0].path, "rb") as f:
        for t in s.tensors:
            if t.torch_dtype is not None:
                st_io.read_tensor(t, f)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("target", ["quantized", "source"])
def test_mutated_checkpoints_load_or_raise_checkpoint_error(
    pristine: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    target: str,
) -> None:
    src, dst = pristine
    _guard_allocations(monkeypatch)
    work = tmp_path / target
    shutil.copytree(dst if target == "quantized" else src, work)
    shard, config = work / SHARD, work / "config.json"
    raw, cfg_text = shard.read_bytes(), config.read_text()
    load = _load_quantized if target == "quantized" else _load_source
    rng = random.Random(f"{target}-{seed}")
    outcomes: dict[str, int] = {"ok": 0, "error": 0}
    for i in range(CASES_PER_SEED):
        shard.write_bytes(raw)
        config.write_text(cfg_text)
        tensor = None
        if target == "quantized" and rng.random() < 0.1:
            cfg = json.loads(cfg_text)
            what = mutate_config(rng, cfg)
            config.write_text(json.dumps(cfg))
        else:
            new, what, tensor = mutate_shard(rng, raw)
            shard.write_bytes(new)
        case = f"{target} seed {seed} case {i} ({what})"
        outcomes[_check(lambda: load(work), case, [SHARD, "config.json"], tensor)] += 1
    # The mutations must reach the checks: most are refused, and some (e.g. metadata
    # deletions or dtype swaps of equal width) still load.
    assert outcomes["error"] > CASES_PER_SEED // 2, outcomes
    assert outcomes["ok"] > 0, outcomes


def test_pristine_checkpoints_load(pristine: tuple[Path, Path]) -> None:
    src, dst = pristine
    _load_quantized(dst)
    _load_source(src)
    assert set(open_checkpoint(dst).modules) == {"l.0.proj", "l.1.proj"}


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda h, m: h["l.0.proj.weight_mbs"].pop("shape"),
            r"entry for tensor 'l\.0\.proj\.weight_mbs': no 'shape'",
        ),
        (
            lambda h, m: h["l.0.proj.weight_mbs"].update(shape=[2.0, 2]),
            r"'l\.0\.proj\.weight_mbs': shape \[2\.0, 2\] is not a list of non-negative",
        ),
        (
            lambda h, m: h["l.0.proj.weight_mbs"].update(shape=[1e999]),
            r"'l\.0\.proj\.weight_mbs': shape \[inf\]",
        ),
        (
            lambda h, m: h["l.0.proj.weight_mbs"].update(data_offsets=[0, 1, 2]),
            r"'l\.0\.proj\.weight_mbs': data_offsets \[0, 1, 2\] is not \[begin, end\]",
        ),
        (
            lambda h, m: h["norm.weight"].update(dtype=7),
            r"'norm\.weight': dtype 7 is not a string",
        ),
        (  # the damaged "shape" of a recorded weight (the KeyError the first fuzzing found)
            lambda h, m: m.update(
                mxplus_weights=m["mxplus_weights"].replace('"shape"', '"shaep"', 1)
            ),
            r"__metadata__ mxplus_weights for tensor l\.\d\.proj\.weight_packed: expected",
        ),
        (
            lambda h, m: m.update(mxplus_weights="[]"),
            r"corrupted __metadata__ mxplus_weights \(not a JSON object\)",
        ),
    ],
    ids=["no-shape", "float-dim", "inf-dim", "three-offsets", "int-dtype", "meta-shape", "meta"],
)
def test_named_header_damage(
    pristine: tuple[Path, Path], tmp_path: Path, mutate, message: str
) -> None:
    work = tmp_path / "q"
    shutil.copytree(pristine[1], work)
    header, data = _split((work / SHARD).read_bytes())
    mutate(header, header["__metadata__"])
    (work / SHARD).write_text("")
    (work / SHARD).write_bytes(_join(header, data))
    with pytest.raises(CheckpointError, match=message) as e:
        open_checkpoint(work)
    assert str(work / SHARD) in str(e.value)


def test_library_rules_apply(pristine: tuple[Path, Path], tmp_path: Path) -> None:
    """Trailing bytes after the last tensor: our offsets are fine, safetensors refuses it
    (and so would vLLM), so the reader refuses it too, naming the file."""
    work = tmp_path / "src"
    shutil.copytree(pristine[0], work)
    with open(work / SHARD, "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: the safetensors library"):
        open_source(work)
