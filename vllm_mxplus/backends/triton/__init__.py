"""The Triton family (CUDA): the fused activation quantizers (`act_quant.py`, MX+
`act_quant_plus.py`, the sm_90a FP8 encoder `act_fp8.py`; shared block code `quant_blocks.py`),
the memory-bound decode GEMM (`decode_gemm.py`), the tiled GEMM (`mx_gemm.py`) and the grouped
MoE GEMM (`moe_gemm.py`) with the device helpers and host-side launch code they share
(`gemm_blocks.py`, `gemm_launch.py`), their custom ops (`ops.py`, `gemm_ops.py`) and the linear
and expert backends (`linear.py`, `experts.py`).
Imported only on a platform that may use it."""
