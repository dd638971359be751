"""Calibrated quantization for `mxplus quantize`: calibration text (`data.py`), input-weighted
group parameters (`group_params.py`, on `formats.mbs_dynamic(weights=...)`), rtn-aware and GPTQ (`rtn_aware.py`,
`gptq.py`) and SmoothQuant-style folds (`smoothing.py`, `smooth_option.py`)."""
