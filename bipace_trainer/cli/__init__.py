"""Command lines: `bipace-train` (train.py at the repository root calls it) and `bipace-eval` (evaluate).

May import everything in the package; nothing in the package imports `cli/`.
"""

import time

from . import threads

# when the program started (wall clock, this process's CPU seconds): what a run's `time:` line counts from.
# Not the process's age: `bash -c "pip install ... && python train.py"` runs python in bash's process.
STARTED = (time.time(), time.process_time())

# before any command line imports torch: libgomp reads OMP_WAIT_POLICY once, when it loads
threads.choose()
