"""The CPU family: C++ kernels (`csrc/`), compiled at first use (`kernels.py`), their torch
ops and fake implementations (`fakes.py`), and the linear and expert backends built on them
(`linear.py`, `experts.py`)."""
