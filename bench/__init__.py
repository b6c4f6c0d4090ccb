"""Product benchmarks: what the trainer's parts cost and how fast they run (results: docs/RESULTS.md,
docs/performance.md). Research studies, which ask whether an estimator helps, live in studies/.

Every script runs as a module from the repository root, so that `bipace_trainer`, `envs`
and `bench` import as packages without path edits (`bench/envs.py` is not `envs`):

    OMP_NUM_THREADS=1 python -m bench.cost --quick
"""

import os

# TRL warns on import of its experimental modules; the benches use them on purpose.
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
