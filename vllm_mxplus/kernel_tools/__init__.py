"""Tooling around the kernels, outside the serving path: `mxplus kernels` (`cli.py`), the
ahead-of-time Triton compiler (`aot.py`) and the launch drivers it compiles (`aot_drivers.py`)."""
