"""How torch's CPU threads wait, chosen before torch loads (docs/performance.md, "Threads on a shared machine").

torch runs each matrix multiply on OpenMP threads (libgomp), which by default spin at the end of
every parallel region waiting for each other. On a machine whose cores are shared (a laptop, a
box running other jobs), one thread descheduled by another process keeps the others spinning:
measured on a 2-core machine, a `generate` call ran 5-7x slower beside a busy process with two
spinning threads than with one thread. `OMP_WAIT_POLICY=PASSIVE` makes waiting threads sleep
instead: as fast as one thread under load, as fast as two when the cores are free
(`python -m bench.threads` measures all three side by side).

libgomp reads the variable once, when it loads (with `import torch`), so `choose()` must run
before that: `bipace_trainer/cli/__init__.py` calls it, and nothing in `bipace_trainer` above
`cli` imports torch at import time. A user's `OMP_NUM_THREADS` or `OMP_WAIT_POLICY` wins: then
nothing is set. A value libgomp would ignore (`OMP_NUM_THREADS=0`, `abc`, `-3`; a policy other
than active or passive) is no choice: it is removed, the default setup is used, and the first
line names it as invalid.
"""

from __future__ import annotations

import os
import re
import sys

USER_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")
POLICY = "PASSIVE"
# What libgomp accepts: a positive count (or a comma list of them, one per nesting level), and a policy
# by name; anything else it ignores (with a warning at most), running its defaults: spinning threads.
VALID = {
    "OMP_NUM_THREADS": re.compile(r"^\s*[1-9]\d*(\s*,\s*[1-9]\d*)*\s*$"),
    "OMP_WAIT_POLICY": re.compile(r"^\s*(active|passive)\s*$", re.IGNORECASE),
}

# what choose() did, for `describe()`: the variables it found set, whether it set the policy,
# and whether torch had loaded already (too late to change how its threads wait)
_chosen: dict = {}


def choose() -> None:
    """Set OMP_WAIT_POLICY=PASSIVE unless the user set OMP_NUM_THREADS or OMP_WAIT_POLICY (they win).
    Runs once per process; later calls keep the first call's record."""
    if _chosen:
        return
    invalid = {}
    for name in USER_VARIABLES:
        value = os.environ.get(name)
        if value is not None and not VALID[name].match(value):
            if value.strip():
                invalid[name] = value
            del os.environ[name]  # libgomp would ignore it and run its default (spinning threads) anyway
    found = {name: os.environ[name] for name in USER_VARIABLES if name in os.environ}
    _chosen.update(found=found, invalid=invalid, set_policy=not found, torch_loaded="torch" in sys.modules)
    if not found:
        os.environ["OMP_WAIT_POLICY"] = POLICY


def describe() -> str:
    """One line for the start of a run: how many threads torch uses and how they wait, and who chose it."""
    import torch  # loaded by now in any caller that trains

    threads = torch.get_num_threads()
    found = _chosen.get("found", {})
    if not _chosen:
        return f"threads: torch uses {threads} (OMP variables as the environment sets them)."
    invalid = "".join(f"{name}={value!r} is invalid (libgomp ignores it), so it is not used; "
                      for name, value in _chosen.get("invalid", {}).items())
    return "threads: " + invalid + _setup(threads, found)


def _setup(threads: int, found: dict[str, str]) -> str:
    """What `describe` says of the setup in use."""
    if found:
        given = ", ".join(f"{name}={value}" for name, value in found.items())
        launcher = " (accelerate launch sets OMP_NUM_THREADS)" if "ACCELERATE_MIXED_PRECISION" in os.environ else ""
        return f"torch uses {threads}, as {given} from the environment says{launcher}; nothing changed."
    if _chosen.get("torch_loaded"):
        return (f"torch uses {threads}; torch was imported before bipace_trainer.cli, too late to set "
                "OMP_WAIT_POLICY=PASSIVE: on shared cores set OMP_WAIT_POLICY=PASSIVE or OMP_NUM_THREADS=1 yourself.")
    return (f"torch uses {threads} with OMP_WAIT_POLICY=PASSIVE (waiting threads sleep instead of spinning, "
            "so cores shared with other programs do not stall every matrix multiply); set OMP_NUM_THREADS or "
            "OMP_WAIT_POLICY to choose yourself.")
