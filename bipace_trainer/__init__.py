"""bipace-trainer: multi-turn LLM agents trained with critic-free, step-level RL on TRL.

    from bipace_trainer import BiPACEConfig, BiPACETrainer

The trainer pulls in TRL and transformers; they are imported on first use, so
`bipace_trainer.advantages` (pure torch) and `bipace_trainer.rollout.actions` stay light.
"""

__all__ = ["BiPACEConfig", "BiPACETrainer", "task_dataset"]
__version__ = "0.1.0"

from ._old_paths import install as _install_old_paths

_install_old_paths()  # the flat layout's module paths, for one release


def __getattr__(name):
    if name == "BiPACEConfig":
        from .config import BiPACEConfig

        return BiPACEConfig
    if name in ("BiPACETrainer", "task_dataset"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'bipace_trainer' has no attribute {name!r}")
