"""train.py with its final save stalled, for the end-of-run tests: `python tests/reliability/stalled_train.py FLAGS`.

With $STALL_FINAL_SAVE (seconds) set, the final save stops for that long after the weights are written
into the staging folder and before the card (so before anything is moved into output_dir), and touches
`<output_dir>/saving-final` first, so a test can signal the process there. Otherwise train.py as is.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bipace_trainer.cli import train  # noqa: E402  (first: it chooses the threads before torch loads)
from bipace_trainer.trainer import BiPACETrainer  # noqa: E402

write_card = BiPACETrainer.create_model_card


def stalled_card(self, model_name=None, dataset_name=None, tags=None, output_dir=None):
    if output_dir is not None and Path(output_dir).name == ".final.staging" and os.environ.get("STALL_FINAL_SAVE"):
        (Path(self.args.output_dir) / "saving-final").touch()
        time.sleep(float(os.environ["STALL_FINAL_SAVE"]))
    return write_card(self, model_name, dataset_name, tags, output_dir)


if __name__ == "__main__":
    BiPACETrainer.create_model_card = stalled_card
    sys.argv[0] = "train.py"
    train.run()
