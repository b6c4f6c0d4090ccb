"""Command lines: `bipace-train` (train.py at the repository root calls it) and `bipace-eval` (evaluate).

May import everything in the package; nothing in the package imports `cli/`.
"""

from . import threads

# before any command line imports torch: libgomp reads OMP_WAIT_POLICY once, when it loads
threads.choose()
