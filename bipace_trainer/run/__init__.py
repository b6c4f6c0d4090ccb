"""A training run's life around the update: where it lives, how it stops, saves, resumes and is evaluated.

    run_dir         whose run an output_dir holds (checked before any weights load), what a stopped run left
    checkpointing   what a checkpoint holds besides TRL's, written atomically; the exact resume
    callbacks       the graceful stop on SIGTERM, the numeric progress bar
    resampling      dynamic sampling (DAPO's), bounded in attempts and time, stoppable
    evaluation      held-out evaluation: which tasks, the summary, when it runs (its callbacks)
    warm_start      the supervised warm start before RL (TRL's SFTTrainer, LoRA);
                    demonstrations: its data, an env expert's (perturbed) play

May import: `rollout/`, `advantages/`, `reports/` (the model card's own README check), `models`.
Never `trainer` or `cli/`: each helper takes the narrow objects it reads or writes (a Protocol
where it needs several), so no module but trainer.py knows `BiPACETrainer`.
"""
