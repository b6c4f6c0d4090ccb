"""The cross-rank reductions a rollout needs: `LocalSync` for one process, `CrossRankSync` over all.

Distributed training needs every rank to make the same generate calls (ZeRO-3 gathers parameters
collectively inside each call): the lockstep loop runs while *any* rank has an active env, and the
number of generate calls per turn is the maximum over ranks (`run_rollouts`). Training metrics
combine over ranks by `CrossRankSync.combine` (`SUMMED_OVER_RANKS` are summed, the rest averaged).
"""

from __future__ import annotations

import torch
from accelerate.utils import gather_object

__all__ = ["LocalSync", "CrossRankSync", "SUMMED_OVER_RANKS"]

# How a training metric combines over ranks: these counts are summed, every other metric
# (rates, means, seconds, settings) is averaged. A name ending in "/" covers the family under it.
SUMMED_OVER_RANKS = (
    "episode/steps", "episode/env_failures", "episode/padded_rows", "env/steps", "env/failures", "env/failures/",
    "train/masked_failed_episodes", "train/masked_failed_steps",
    "rollout/prompt_tokens", "rollout/prompt_tokens_shared", "rollout/prompt_tokens_prefix_of_previous",
    "rollout/prompt_tokens_encoded", "rollout/prompt_tokens_reused",
)


class LocalSync:
    """Single-process stand-in for the cross-rank reductions the rollout needs."""

    def any(self, flag: bool) -> bool:
        return flag

    def max(self, value: int) -> int:
        return value


    def mean(self, value: float) -> float:
        return value


class CrossRankSync:
    """The reductions the lockstep rollout needs, over all processes."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def any(self, flag: bool) -> bool:
        return bool(self.max(int(flag)))

    def max(self, value: int) -> int:
        if self.accelerator.num_processes == 1:
            return value
        tensor = torch.tensor([value], device=self.accelerator.device)
        return int(self.accelerator.gather(tensor).max())

    def mean(self, value: float) -> float:
        """The mean over ranks, NaN ignored (the estimator's `reduce`)."""
        if self.accelerator.num_processes == 1:
            return value
        gathered = self.accelerator.gather(torch.tensor([value], dtype=torch.float64, device=self.accelerator.device))
        return float(torch.nanmean(gathered))

    def combine(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric over ranks: summed if in `SUMMED_OVER_RANKS`, else averaged (a rank without it is left out)."""
        per_rank = gather_object([metrics]) if self.accelerator.num_processes > 1 else [metrics]
        families = tuple(name for name in SUMMED_OVER_RANKS if name.endswith("/"))
        out = {}
        for key in sorted({k for m in per_rank for k in m}):
            values = [m[key] for m in per_rank if key in m and m[key] is not None]
            summed = key in SUMMED_OVER_RANKS or key.startswith(families)
            out[key] = float(sum(values)) if summed else float(sum(values) / len(values))
        return out
