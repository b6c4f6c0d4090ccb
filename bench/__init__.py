"""Benchmarks and the learning study (their results: docs/RESULTS.md, README's Performance section).

Every script runs as a module from the repository root, so that `bipace_trainer`, `envs`
and `bench` import as packages without path edits (`bench/envs.py` is not `envs`):

    OMP_NUM_THREADS=1 python -m bench.learning_study --quick
"""

import os

# TRL warns on import of its experimental modules; the benches use them on purpose.
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
