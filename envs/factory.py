"""Building an env from its registry name (or dotted path) and its kwargs.

    env = make_env("textcraft", surface_variation=0.5)     # a TextCraft engine in SurfaceVariation

Apart from `envs.base` because it needs both the registry (`envs.base`) and the wrapper
(`envs.surface`, a `TextEnv` subclass, so it imports `envs.base`): here neither of those two
modules imports the other back.
"""

from __future__ import annotations

from typing import Any, Callable

from .base import TextEnv, resolve_env_class
from .surface import SurfaceVariation, split_surface_kwargs

__all__ = ["make_env", "build_env"]


def make_env(name: str, **env_kwargs: Any) -> TextEnv:
    """Build one env instance by registry name or dotted path.

    `surface_variation` (and `surface_seed`) among the kwargs wrap the env in
    `envs.surface.SurfaceVariation` instead of reaching its constructor.
    """
    return build_env(resolve_env_class(name), env_kwargs)


def build_env(
    env_class: type[TextEnv] | Callable[..., TextEnv], env_kwargs: dict[str, Any] | None, stream: int | None = None
) -> TextEnv:
    """`env_class(**env_kwargs)`, wrapped in `SurfaceVariation` when env_kwargs ask for it (one owner
    of that rule for `make_env` and `VectorEnv`); `stream` numbers the wrapper (see envs.surface)."""
    engine_kwargs, surface_kwargs = split_surface_kwargs(env_kwargs)
    env = env_class(**engine_kwargs)
    return SurfaceVariation(env, stream=stream, **surface_kwargs) if surface_kwargs else env
