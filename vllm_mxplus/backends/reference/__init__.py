"""The reference family: the numerics of `vllm_mxplus.formats` computed in torch (dequantized
fp32 weights, fake-quantized activations). Serves any scheme on any device; the selector keeps
it only where no kernel covers an M, or where the user forces it (`VLLM_MXPLUS_BACKEND`)."""
