"""Calibrated quantization for `mxplus quantize`: calibration text (`data.py`), rtn-aware and
GPTQ (`rtn_aware.py`, `gptq.py`) on the input-weighted group parameters of
`formats.choose_params(..., weights=d)`, and SmoothQuant-style folds (`smoothing.py`,
`smooth_option.py`)."""
