"""Command lines: `bipace-train` (train.py at the repository root calls it) and `bipace-eval` (evaluate).

May import everything in the package; nothing in the package imports `cli/`.
"""
