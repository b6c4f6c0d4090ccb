"""Train a multi-turn text agent with step-level RL: `python train.py` or `accelerate launch train.py`.

The command line lives in the package (`bipace_trainer/cli/train.py`, also the console script
`bipace-train`); this file stays so that `accelerate launch train.py --config recipes/...` works
from a checkout. `python train.py --help` lists every flag.
"""

from bipace_trainer.cli.train import run

if __name__ == "__main__":
    run()
