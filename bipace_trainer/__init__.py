"""bipace-trainer: multi-turn LLM agents trained with critic-free, step-level RL on TRL.

    from bipace_trainer import BiPACEConfig, BiPACETrainer

The trainer pulls in TRL and transformers; they are imported on first use, so
`bipace_trainer.advantages` (pure torch) and `bipace_trainer.rollout.actions` stay light.
"""

__all__ = ["BiPACEConfig", "BiPACETrainer", "task_dataset"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "BiPACEConfig":
        from .config import BiPACEConfig

        return BiPACEConfig
    if name == "BiPACETrainer":
        from .trainer import BiPACETrainer

        return BiPACETrainer
    if name == "task_dataset":
        from .rollout.collector import task_dataset

        return task_dataset
    raise AttributeError(f"module 'bipace_trainer' has no attribute {name!r}")
