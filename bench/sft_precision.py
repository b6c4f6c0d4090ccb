"""SFT step time on a CPU: TRL's default precision (bf16, autocast) against float32, side by side.

    OMP_NUM_THREADS=1 python -m bench.sft_precision            # the learning study's 256 x 4 policy
    OMP_NUM_THREADS=1 python -m bench.sft_precision --steps 4 --hidden-size 64 --layers 2

TRL's `SFTConfig` defaults to `bf16=True`, and transformers honours it on a CPU (`use_cpu=True`)
by autocasting to bfloat16: without AVX-512 bf16 kernels that is the slow path. Both runs train
the same freshly initialised model on the same TextCraft demonstration rows, in one process,
one after the other; the first logged losses show the two are the same training up to rounding.
`bench.common.sft_warm_start` trains in float32 on a CPU because of this.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from datasets import Dataset

from bench import common
from bipace_trainer.run.demonstrations import collect_demonstrations
from envs.base import resolve_env_class


def time_sft(tokenizer, dataset, args, bf16: bool | None) -> dict:
    from trl import SFTConfig, SFTTrainer

    model = common.tiny_model(tokenizer, hidden_size=args.hidden_size, layers=args.layers)
    precision = {} if bf16 is None else {"bf16": bf16}
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3, gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, seed=0, disable_tqdm=True, **precision,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    seconds = (time.perf_counter() - start) / args.steps
    first_loss = trainer.state.log_history[0]["loss"]
    return {"bf16": config.bf16, "mixed_precision": trainer.accelerator.mixed_precision, "s_per_step": seconds,
            "first_loss": first_loss}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    specs = resolve_env_class("textcraft").tasks("train")[:20]
    rows = collect_demonstrations("textcraft", [spec.task_id for spec in specs], history_length=1)
    tokenizer = common.train_tokenizer("textcraft", rows)
    dataset = Dataset.from_list([{"prompt": row["prompt"], "completion": row["completion"]} for row in rows])
    runs = [time_sft(tokenizer, dataset, args, bf16) for bf16 in (None, False)]  # TRL's default, then float32
    print(f"{'precision':>22}{'s/step':>9}{'first loss':>12}   ({common.machine().get('cpu')}, "
          f"{torch.get_num_threads()} thread(s))")
    for run in runs:
        label = f"bf16={run['bf16']} ({run['mixed_precision']})"
        print(f"{label:>22}{run['s_per_step']:>9.2f}{run['first_loss']:>12.6f}")
    print(f"TRL's default / float32: {runs[0]['s_per_step'] / runs[1]['s_per_step']:.1f}x the time per step")
    return {"runs": runs}


if __name__ == "__main__":
    main()
