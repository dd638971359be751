"""Calibrated quantization for `mxplus quantize`: calibration text (`data.py`), input-weighted
group parameters (`group_params.py`, `weighted_mbs.py`), rtn-aware and GPTQ (`rtn_aware.py`,
`gptq.py`) and SmoothQuant-style folds (`smoothing.py`, `smooth_option.py`)."""
