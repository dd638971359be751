"""Shape-only implementations of the CPU kernels' ops (`cpu_kernels`), registered once the
library is loaded, so torch.compile / FakeTensor tracing can use them."""

from __future__ import annotations

import torch

from vllm_mxplus.backends.library import op_name
from vllm_mxplus.formats.constants import MX_BLOCK, ceil_div
from vllm_mxplus.formats.nvfp4 import NVFP4_BLOCK


def register_fakes(tile_n: int) -> None:
    """Shape-only implementations so torch.compile / FakeTensor tracing can use the ops;
    tile_n: weight rows per packed tile (`kernels.tile_n`)."""

    @torch.library.register_fake(op_name("cpu_act_fake_quant"))
    def _(x, block, rule, mbs, macro):
        return torch.empty(x.shape, dtype=torch.float32, device=x.device)

    @torch.library.register_fake(op_name("cpu_act_quant"))
    def _(x, block, rule, mbs, macro):
        k = x.shape[-1]
        m = x.numel() // k
        return (
            x.new_empty((m, k), dtype=torch.int8),
            x.new_empty((m, ceil_div(k, block)), dtype=torch.uint8),
            x.new_empty((m, ceil_div(k, macro) if mbs else 0), dtype=torch.uint8),
        )

    @torch.library.register_fake(op_name("cpu_dequant_weight"))
    def _(codes, scales, mbs, k, block, macro):
        return codes.new_empty((codes.shape[0], k), dtype=torch.float32)

    @torch.library.register_fake(op_name("cpu_pack_weight"))
    def _(codes, scales, mbs, k, block, macro):
        nt, nb = ceil_div(codes.shape[0], tile_n), ceil_div(k, block)
        return (
            codes.new_empty((nt, nb * block // 2 * tile_n)),
            codes.new_empty((nt, nb * tile_n)),
            codes.new_empty((nt, ceil_div(k, macro) * tile_n) if mbs.numel() else (0, 0)),
        )

    @torch.library.register_fake(op_name("cpu_nvfp4_act_quant"))
    def _(x):
        k = x.shape[-1]
        m = x.numel() // k
        return (
            x.new_empty((m, k), dtype=torch.int8),
            x.new_empty((m, ceil_div(k, NVFP4_BLOCK)), dtype=torch.uint8),
            x.new_empty((m,), dtype=torch.float32),
        )

    @torch.library.register_fake(op_name("cpu_nvfp4_linear"))
    def _(x, wcodes, wscales, wglobal, n, k, act_global_scale, bias, out_dtype):
        return x.new_empty((*x.shape[:-1], n), dtype=out_dtype)

    @torch.library.register_fake(op_name("cpu_mx_linear"))
    def _(
        x,
        act_block,
        act_rule,
        act_mbs,
        macro,
        wcodes,
        wscales,
        wmbs,
        n,
        k,
        w_block,
        bias,
        out_dtype,
    ):
        return x.new_empty((*x.shape[:-1], n), dtype=out_dtype)

    @torch.library.register_fake(op_name("cpu_mxplus_pack_weight"))
    def _(codes, scales, bm_index, k):
        nt, nb = ceil_div(codes.shape[0], tile_n), ceil_div(k, MX_BLOCK)
        return (
            codes.new_empty((nt, nb * MX_BLOCK // 2 * tile_n)),
            codes.new_empty((nt, nb * tile_n)),
            codes.new_empty((nt, nb * 2 * tile_n)),
        )

    @torch.library.register_fake(op_name("cpu_mxplus_linear"))
    def _(x, wcodes, wscales, wbm, n, k, bias, out_dtype):
        return x.new_empty((*x.shape[:-1], n), dtype=out_dtype)

    @torch.library.register_fake(op_name("cpu_amx_gemm"))
    def _(a, w, ra, rw, chunk, m, n, ga, gw, bias, out_dtype):
        return a.new_empty((m, n), dtype=out_dtype)

    @torch.library.register_fake(op_name("cpu_amx_packed_gemm"))
    def _(a, codes, scales, block, k, ra, rw, chunk, m, n, bias, out_dtype):
        return a.new_empty((m, n), dtype=out_dtype)

    @torch.library.register_fake(op_name("cpu_amx_int8_linear"))
    def _(x, block, rule, act_mbs, macro, wcodes, wscales, wmbs, rw, n, k, bias, out_dtype, *held):
        return x.new_empty((*x.shape[:-1], n), dtype=out_dtype)

    @torch.library.register_fake(op_name("cpu_amx_unpack"))
    def _(codes, scales, block, k, n, kp, scalar):
        return codes.new_empty((-(-n // 32) * 2, kp // 32, 16, 32), dtype=torch.bfloat16)

    @torch.library.register_fake(op_name("cpu_amx_act_operand"))
    def _(codes, half, block, mp, kp):
        return codes.new_empty((mp, kp), dtype=torch.bfloat16)

    @torch.library.register_fake(op_name("cpu_amx_act_quant"))
    def _(x, block, rule, mbs, macro, mp, kp, chunks):
        return (
            x.new_empty((mp, kp), dtype=torch.bfloat16),
            x.new_empty((mp, chunks), dtype=torch.float32),
        )
