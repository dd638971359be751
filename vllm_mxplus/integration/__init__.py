"""vLLM integration: QuantizationConfig per scheme, the LinearMethod, registration.

Import submodules directly (they import vLLM); this package itself imports nothing heavy.
"""
