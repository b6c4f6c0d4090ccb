"""Command lines that build a trainer: `bipace-eval` (evaluate). train.py, at the repository root, is the other.

May import everything in the package; nothing in the package imports `cli/`.
"""
