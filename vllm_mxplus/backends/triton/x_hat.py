"""The decode GEMM's prepared activation: x_hat in the word order of its weight dots.

The decode GEMM (`decode_gemm`) reads weight codes as int32 words of 8 codes and runs four
dots per K step, dot p over the elements 8j + p and 8j + p + 4 of every word j
(`gemm_blocks.e2m1_word_values`). Dequantizing the activation's codes the same way costs
every warp of every program the whole x tile again, per step. `act_quant_hat` instead writes
x_hat = E2M1 value * block scale (MBS factor not applied: the GEMM scales partial sums by
sigma_x) once, as bf16 (exact: two significant bits, fp32's exponent range), in that order,
so each dot's x operand is one contiguous load:

    within each HAT_CHUNK (128) elements of a row, element 8j + 4h + p (j < 16, h < 2, p < 4)
    is stored at position 32p + 2j + h

Rows are padded with zeros to whole chunks (`hat_cols`). With MBS, `act_quant_hat` also
writes sigma_x = fp32(1 / F) per row and macro block (fp32, the MBS bytes' shape), which the
GEMM reads instead of computing it from the byte in every program. `to_hat_order` is the same
permutation in torch, the reference the tests compare the kernel's bytes with.
"""

from __future__ import annotations

import torch

from vllm_mxplus.formats.constants import ceil_div

HAT_CHUNK = 128  # elements per permuted chunk: the decode GEMM's K step (`GPU_BLOCK_K`)
HAT_DTYPE = torch.bfloat16


def hat_cols(k: int) -> int:
    """Columns of the prepared activation of K elements: whole chunks."""
    return ceil_div(k, HAT_CHUNK) * HAT_CHUNK


def to_hat_order(x_hat: torch.Tensor) -> torch.Tensor:
    """x_hat [M, K] (natural order) -> [M, hat_cols(K)] in the word order above, zero-padded."""
    m, k = x_hat.shape
    padded = torch.zeros((m, hat_cols(k)), dtype=x_hat.dtype, device=x_hat.device)
    padded[:, :k] = x_hat
    # [M, chunk, j, h, p] -> [M, chunk, p, j, h]
    return padded.reshape(m, -1, 16, 2, 4).permute(0, 1, 4, 2, 3).reshape(m, -1)
