"""Real sizes: what quantizing and serving a Llama-3.2-1B- or Llama-3.1-8B-shaped model costs.

    nice -n 10 python benchmarks/bench_real_size.py --config 1b|8b [--workdir /tmp/mxplus-real]
        [--parts gen,rtn,nvfp4,calib,serve,online,bf16] [--calib-nsamples 8 --calib-seqlen 256]
        [--calib-methods rtn-aware,gptq]
        [--keep]

A full-depth bf16 checkpoint with the config's shapes is written tensor by tensor (random
weights: N(0, 1) values from a shared pool of 2^24 samples at random offsets, per output
channel scales drawn log-normally, a few outlier input channels x8 per layer, as trained LLM
weights show; the writer holds one tensor), with a 128256-word
word-level tokenizer so that vLLM can serve it offline. Then each part runs in its own
subprocess, measured for wall time and peak RSS of the whole process tree (sampled every
0.2 s over /proc, children included):

* gen:    writing the bf16 source;
* rtn:    `mxplus quantize --scheme mxfp4-mbs` (RTN, MBS-D exhaustive), full depth;
* nvfp4:  `mxplus quantize --scheme nvfp4`, full depth;
* calib:  `mxplus quantize --method rtn-aware` and `--method gptq` (mxfp4-mbs) on slices of
          the same shapes with 1 and 2 decoder layers: per-layer cost = t(2) - t(1), so the
          full model extrapolates as t(1) + (layers - 1) * per-layer;
* serve:  vLLM (CPU, eager) on the pre-quantized mxfp4-mbs checkpoint: load time, RSS after
          load, decode tokens/s at batch 1 and 4;
* online: vLLM on the bf16 checkpoint with --quantization mxfp4-mbs-s (the MBS-S weights:
          MBS-D at load is minutes per 10^8 weights on CPU), peak RSS during load;
* bf16:   vLLM on the bf16 checkpoint unquantized, where it fits (the baseline of serve).

Ratios against named baselines in the same run: each quantizer's peak RSS / the bf16 source
size, serving RSS after load / the checkpoint's bytes, quantized decode / bf16 decode.
Everything is written under --workdir (default /tmp/mxplus-real-CONFIG) and removed at the
end unless --keep.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _llama(hidden: int, inter: int, layers: int, heads: int, kv: int, head_dim: int, tied: bool):
    """A Llama config's sizes (the rest comes from LlamaConfig's defaults)."""
    return dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        tie_word_embeddings=tied,
    )


CONFIGS: dict[str, dict[str, Any]] = {
    "1b": _llama(2048, 8192, 16, 32, 8, 64, True),  # Llama-3.2-1B: tied embeddings
    "tiny": _llama(256, 512, 2, 4, 2, 64, False),  # a smoke test of this script, not a real size
    "8b": _llama(4096, 14336, 32, 32, 8, 128, False),  # Llama-3.1-8B
}
COMMON = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=128256,
    max_position_embeddings=2048,  # small KV cache; the weights are the full model's
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
    torch_dtype="bfloat16",
)
SHARD_BYTES = 5 * 1024**3
OUTLIERS = 8  # outlier input channels per layer
PROMPT = "the capital of france is"
DECODE_TOKENS = 32

ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


# ---------------------------------------------------------------- the source checkpoint


def config_for(name: str, layers: int | None = None) -> dict[str, Any]:
    cfg = {**COMMON, **CONFIGS[name]}
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


def tensor_shapes(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The Llama checkpoint's tensors in transformers' order and names."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}"
        out += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (nq * hd, h)),
            (f"{p}.self_attn.k_proj.weight", (nkv * hd, h)),
            (f"{p}.self_attn.v_proj.weight", (nkv * hd, h)),
            (f"{p}.self_attn.o_proj.weight", (h, nq * hd)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (i, h)),
            (f"{p}.mlp.up_proj.weight", (i, h)),
            (f"{p}.mlp.down_proj.weight", (h, i)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (v, h)))
    return out


POOL = 1 << 24  # N(0, 1) samples shared by every tensor (64 MiB fp32)
_pool: list[Any] = []


def _normal_pool():  # noqa: ANN202
    """2 x POOL N(0, 1) samples (the second half repeats the first), drawn once: drawing 8e9
    fresh normals would take the 2-core machine over an hour; a slice at a random offset is
    as good for what is measured here (time and memory, not accuracy)."""
    import torch

    if not _pool:
        base = torch.randn(POOL, generator=torch.Generator().manual_seed(0))
        _pool.append(torch.cat([base, base]))
    return _pool[0]


def random_weight(name: str, shape: tuple[int, ...], seed: int):  # noqa: ANN201
    """bf16: norms ~1; 2-D weights N(0, 1) (a slice of the shared pool at a random offset per
    chunk of rows) * per-row scale (log-normal around 0.02 / sqrt(K / 4096)) with OUTLIERS
    input channels of the layer x8."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if len(shape) == 1:
        return (1.0 + 0.1 * torch.randn(shape, generator=g)).bfloat16()
    n, k = shape
    pool = _normal_pool()
    out = torch.empty(shape, dtype=torch.bfloat16)
    rows = torch.exp(0.3 * torch.randn(n, 1, generator=g)) * (0.02 / math.sqrt(k / 4096))
    layer_seed = int(name.split("layers.")[1].split(".")[0]) if "layers." in name else 0
    cols = torch.randperm(k, generator=torch.Generator().manual_seed(layer_seed))[:OUTLIERS]
    col_scale = torch.ones(k)
    col_scale[cols] = 8.0
    step = max(1, POOL // k)
    for r in range(0, n, step):
        m = min(step, n - r)
        off = int(torch.randint(0, POOL, (1,), generator=g))
        w = pool[off : off + m * k].view(m, k) * rows[r : r + m] * col_scale
        out[r : r + m] = w.bfloat16()
    return out


def write_source(path: Path, cfg: dict[str, Any]) -> int:
    """The bf16 checkpoint (shards of <= SHARD_BYTES, an index) and a 128256-word tokenizer;
    returns its weight bytes."""
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    import tiny_models  # the word-level tokenizer builder of the test models

    from vllm_mxplus.checkpoint.safetensors_io import PlannedTensor, StreamingWriter

    path.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_shapes(cfg):
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for s, tensors in enumerate(shards):
        file = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        plan = [PlannedTensor(n, "BF16", shp) for n, shp in tensors]
        writer = StreamingWriter(path / file, plan, {"format": "pt"})
        for seed, (name, shape) in enumerate(tensors, start=1000 * s):
            writer.write(name, random_weight(name, shape, seed))
            weight_map[name] = file
            total += 2 * math.prod(shape)
        writer.close()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    tiny_models.build_tokenizer(path, cfg["vocab_size"])
    return total


# ---------------------------------------------------------------- measuring a process tree


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):  # a child that just exited
            total += p.memory_info().rss
    return total


def measure(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run cmd; wall seconds, peak RSS of its process tree (bytes), its stdout, exit code."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, **(env or {})})
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _tree_rss(proc.pid))
            time.sleep(0.2)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    return {"wall": wall, "peak": peak, "stdout": stdout, "rc": proc.returncode, "stderr": stderr}


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(".safetensors"))


# ---------------------------------------------------------------- vLLM child


def serve_child(model: str, quantization: str | None) -> None:
    """In a subprocess: load time, RSS after load, decode tok/s at batch 1 and 4 (JSON)."""
    import gc

    import psutil
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, quantization=quantization, **ENGINE)
    load = time.perf_counter() - t0
    rss_loaded = _tree_rss(os.getpid())
    res: dict[str, Any] = {"load_s": load, "rss_after_load": rss_loaded}
    sp = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    for batch in (1, 4):
        t1 = time.perf_counter()
        outs = llm.generate([PROMPT] * batch, sp, use_tqdm=False)
        dt = time.perf_counter() - t1
        res[f"tok_s_b{batch}"] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
    res["rss_end"] = psutil.Process().memory_info().rss
    print("RESULT " + json.dumps(res), flush=True)
    del llm
    gc.collect()
    # vLLM's CPU engine may abort at interpreter shutdown: the run is judged by its RESULT line
    os._exit(0)


def _serve(model: Path, quantization: str | None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--serve-child", str(model)]
    if quantization:
        cmd += ["--serve-quantization", quantization]
    m = measure(cmd, ENV)
    lines = [ln for ln in m["stdout"].splitlines() if ln.startswith("RESULT ")]
    if not lines:
        print(f"  vLLM on {model.name} ({quantization or 'bf16'}) failed, rc {m['rc']}:")
        print("  " + "\n  ".join(m["stderr"].splitlines()[-15:]))
        return {**m, "ok": False}
    return {**m, **json.loads(lines[-1][len("RESULT ") :]), "ok": True}


# ---------------------------------------------------------------- parts


def _quantize(src: Path, dst: Path, *args: str) -> dict[str, Any]:
    cmd = [str(Path(sys.executable).parent / "mxplus"), "quantize", str(src), str(dst), "--force"]
    m = measure([*cmd, "--no-progress", "--device", "cpu", *args])
    if m["rc"] != 0:
        print(f"  mxplus quantize {' '.join(args)} failed (rc {m['rc']}):")
        print("  " + "\n  ".join(m["stderr"].splitlines()[-10:]))
    return m


ENGINE = dict(dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0)
RTN_SCHEME_HELP = (
    "scheme of the rtn part and of the checkpoint `serve` loads (mxfp4-mbs-s: the same "
    "bytes and kernels without MBS-D's exhaustive search, ~7x faster to quantize)"
)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", choices=sorted(CONFIGS), default="1b")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--parts", default="gen,rtn,nvfp4,calib,serve,online,bf16")
    ap.add_argument("--rtn-scheme", default="mxfp4-mbs", help=RTN_SCHEME_HELP)
    ap.add_argument("--calib-nsamples", type=int, default=8)
    ap.add_argument("--calib-seqlen", type=int, default=256)
    ap.add_argument(
        "--calib-methods",
        default="rtn-aware,gptq",
        help="calibrated methods the calib part measures (comma-separated)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    ap.add_argument("--serve-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve-quantization", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_child:
        os.environ.update(ENV)
        serve_child(args.serve_child, args.serve_quantization)
        return 0

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_cpu_linear import machine_line

    parts = set(args.parts.split(","))
    work = args.workdir or Path(f"/tmp/mxplus-real-{args.config}")
    work.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(machine_line())
    print(f"torch {torch.__version__}, commit {commit}, config {args.config}, workdir {work}")
    cfg = config_for(args.config)
    n_layers = cfg["num_hidden_layers"]
    src, rows = work / "bf16", []

    def row(part: str, m: dict[str, Any], note: str) -> None:
        line = f"{part:34s} {m['wall']:9.1f} {_gib(m['peak']):>9s}  {note}"
        rows.append(line)
        print(line, flush=True)

    print(f"{'part':34s} {'wall s':>9s} {'peak GiB':>9s}  notes")
    needs_source = bool(parts & {"gen", "rtn", "nvfp4", "online", "bf16"})
    if "gen" in parts or (needs_source and not (src / "config.json").is_file()):
        code = (
            "import sys, json; sys.path.insert(0, sys.argv[1]); import bench_real_size as b; "
            "print(b.write_source(b.Path(sys.argv[2]), json.loads(sys.argv[3])))"
        )
        m = measure(
            [sys.executable, "-c", code, str(Path(__file__).parent), str(src), json.dumps(cfg)]
        )
        assert m["rc"] == 0, m["stderr"][-3000:]
        row("gen bf16 source", m, f"{_gib(int(m['stdout'].split()[-1]))} GiB of weights written")
    src_bytes = dir_bytes(src) if src.is_dir() else 0
    quantized = work / args.rtn_scheme
    for part, scheme, dst in (("rtn", args.rtn_scheme, quantized),):
        if part in parts:
            m = _quantize(src, dst, "--scheme", scheme)
            if m["rc"] == 0:
                row(
                    f"quantize {scheme} RTN {n_layers} layers",
                    m,
                    f"peak / bf16 source = {m['peak'] / src_bytes:.3f}; "
                    f"output {_gib(dir_bytes(dst))} GiB",
                )
    base = None
    if "bf16" in parts:
        b = _serve(src, None)
        if b["ok"]:
            base = b
            row(
                "vLLM bf16 (unquantized)",
                b,
                f"load {b['load_s']:.0f} s, RSS after load {_gib(b['rss_after_load'])} GiB "
                f"(/ checkpoint {b['rss_after_load'] / src_bytes:.2f}), decode b1 "
                f"{b['tok_s_b1']:.2f} tok/s, b4 {b['tok_s_b4']:.2f} tok/s",
            )
    if "serve" in parts and (quantized / "config.json").is_file():
        s = _serve(quantized, None)
        if s["ok"]:
            q_bytes = dir_bytes(quantized)
            ratio = (
                f"; decode b1 / bf16 {s['tok_s_b1'] / base['tok_s_b1']:.2f}, "
                f"b4 / bf16 {s['tok_s_b4'] / base['tok_s_b4']:.2f}"
                if base
                else ""
            )
            row(
                f"vLLM pre-quantized {args.rtn_scheme}",
                s,
                f"load {s['load_s']:.0f} s, RSS after load {_gib(s['rss_after_load'])} GiB "
                f"(/ checkpoint {s['rss_after_load'] / q_bytes:.2f}), decode b1 "
                f"{s['tok_s_b1']:.2f} tok/s, b4 {s['tok_s_b4']:.2f} tok/s{ratio}",
            )
    if "online" in parts:
        o = _serve(src, "mxfp4-mbs-s")
        if o["ok"]:
            row(
                "vLLM bf16 + --quantization mxfp4-mbs-s",
                o,
                f"load {o['load_s']:.0f} s (peak = during load), RSS after load "
                f"{_gib(o['rss_after_load'])} GiB, decode b1 {o['tok_s_b1']:.2f} tok/s, "
                f"b4 {o['tok_s_b4']:.2f} tok/s",
            )
    if "nvfp4" in parts:
        m = _quantize(src, work / "nvfp4", "--scheme", "nvfp4")
        if m["rc"] == 0:
            row(
                f"quantize nvfp4 RTN {n_layers} layers",
                m,
                f"peak / bf16 source = {m['peak'] / src_bytes:.3f}; "
                f"output {_gib(dir_bytes(work / 'nvfp4'))} GiB",
            )
        shutil.rmtree(work / "nvfp4", ignore_errors=True)
    if "calib" in parts:
        text = work / "calib.txt"
        words = " ".join(tiny_words())
        text.write_text("\n".join([words] * 400))
        for method in args.calib_methods.split(","):
            walls = {}
            for layers in (1, 2):
                sl = work / f"slice{layers}"
                if not (sl / "config.json").is_file():
                    write_source(sl, config_for(args.config, layers))
                m = _quantize(
                    sl,
                    work / f"slice{layers}-{method}",
                    "--scheme",
                    "mxfp4-mbs",
                    "--method",
                    method,
                    "--calib",
                    str(text),
                    "--nsamples",
                    str(args.calib_nsamples),
                    "--seqlen",
                    str(args.calib_seqlen),
                )
                shutil.rmtree(work / f"slice{layers}-{method}", ignore_errors=True)
                if m["rc"] != 0:
                    break
                walls[layers] = m["wall"]
                row(
                    f"quantize {method} {layers} layer(s)",
                    m,
                    f"peak / bf16 slice = {m['peak'] / dir_bytes(sl):.3f}",
                )
            if len(walls) == 2:
                per = walls[2] - walls[1]
                print(
                    f"  {method}: {per:.1f} s per layer; {n_layers} layers extrapolated: "
                    f"{(walls[1] + (n_layers - 1) * per) / 3600:.2f} h",
                    flush=True,
                )
    print("\n".join(["", "summary:", *rows]))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def tiny_words() -> list[str]:
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    import tiny_models

    return list(tiny_models.WORDS)


if __name__ == "__main__":
    sys.exit(main())
