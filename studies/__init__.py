"""Research studies: each folder asks one question of the estimators (does BiPACE_Q learn faster than
GiGPO here? how close is each estimator to an oracle?) and holds its scripts, its README (question,
command, result, date, machine) and its results. Product benchmarks, which measure what the trainer
costs, are in bench/; the studies reuse its tiny offline policy (`bench.common`).

Every script runs as a module from the repository root:

    OMP_NUM_THREADS=1 python -m studies.learning.study --quick
"""

import os

# TRL warns on import of its experimental modules; the studies use them on purpose.
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
