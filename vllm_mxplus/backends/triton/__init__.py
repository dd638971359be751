"""The Triton family (CUDA): the fused activation quantizers (`act_quant.py`, MX+ and NVFP4
with given global scales `act_quant_plus.py`; shared block code `quant_blocks.py`, also used
by the CUTLASS path's sm_90a FP8 encoder `backends/cutlass/act_fp8.py`),
the memory-bound decode GEMM (`decode_gemm.py`), the tiled GEMM (`mx_gemm.py`) and the grouped
MoE GEMM (`moe_gemm.py`) with the device helpers and host-side launch code they share
(`gemm_blocks.py`, `gemm_launch.py`), their custom ops (`ops.py`, `gemm_ops.py`) and the linear
and expert backends (`linear.py`, `experts.py`).
Imported only on a platform that may use it."""
