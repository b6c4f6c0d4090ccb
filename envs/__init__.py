"""Text environments behind one interface (`envs.base`), and the registry.

`make_env(name, **kwargs)` builds one; `VectorEnv` runs many with timeouts and
failure capture; `as_trl_environment(name)` and `trl_task_dataset(name)` hand one to
TRL's `GRPOTrainer(environment_factory=..., train_dataset=...)` (`envs.trl_env`).
Engines with heavy optional dependencies are registered lazily: their module is
imported the first time their name is asked for, so `import envs` never needs them.
"""

from .base import (
    EnvUnavailableError,
    StepResult,
    TaskSpec,
    TextEnv,
    normalise_action,
    register_env,
    registered_envs,
    resolve_env_class,
)
from .factory import build_env, make_env
from .surface import SurfaceVariation, unwrap
from .tiny import TinyEnv
from .trl_env import EnvironmentFailure, as_trl_environment, trl_task_dataset
from .vector import VectorEnv

register_env("textcraft", lazy_module="envs.textcraft")
register_env("scienceworld", lazy_module="envs.scienceworld")
register_env("alfworld", lazy_module="envs.alfworld")
register_env("webshop", lazy_module="envs.webshop")

__all__ = [
    "EnvUnavailableError",
    "EnvironmentFailure",
    "StepResult",
    "TaskSpec",
    "SurfaceVariation",
    "TextEnv",
    "TinyEnv",
    "VectorEnv",
    "as_trl_environment",
    "build_env",
    "make_env",
    "normalise_action",
    "register_env",
    "registered_envs",
    "resolve_env_class",
    "trl_task_dataset",
    "unwrap",
]
