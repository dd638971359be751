"""The CUTLASS family (CUDA): prefill GEMMs with MBS (sources in `csrc/`, built by `build.py`),
their custom ops (`ops.py`), prepared weights and the exact fallback (`gemm.py`), the FP8 chunk
re-encoding they are held to (`fp8_chunks.py`) and the prefill backend (`linear.py`)."""
