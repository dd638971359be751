"""The Triton family (CUDA): the fused activation quantizer, the memory-bound decode GEMM, the
sm_90a FP8 activation encoder, their custom ops (`ops.py`) and the linear backends (`linear.py`).
Imported only on a platform that may use it."""
