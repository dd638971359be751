"""The lm-eval runner and table builder behind `mxplus eval` (paper §5, Tables 1-3, 5, 6).

config.py validates the YAML configs (configs/), runner.py runs one lm-eval worker process
per cell, table.py builds the paper-shaped markdown table, JSON and chart.
"""
