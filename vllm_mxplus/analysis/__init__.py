"""Fidelity analysis: QSNR per format for weights, activations and GEMM outputs (paper §4.4)."""
