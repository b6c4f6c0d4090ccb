"""Statistics of `oracle_study.py`: estimator advantages against the oracle's A*, value proxies
against V*, and state partitions against the true state. Pure numpy/scipy on flat step arrays.

All "pairs" are pairs of distinct steps of the same task group (cells never cross groups).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

import numpy as np
from scipy import stats

__all__ = ["correlations", "pair_sign_agreement", "value_error", "cell_means", "grouping_quality"]


def correlations(advantage: Sequence[float], a_star: Sequence[float]) -> dict[str, float]:
    """Spearman and Pearson correlation of step advantages with A*; NaN when either is constant."""
    x, y = np.asarray(advantage, float), np.asarray(a_star, float)
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return {"spearman": math.nan, "pearson": math.nan}
    return {"spearman": float(stats.spearmanr(x, y).statistic), "pearson": float(stats.pearsonr(x, y).statistic)}


def pair_sign_agreement(
    advantage: Sequence[float], a_star: Sequence[float], state: Sequence[int], group: Sequence[int], tol: float = 1e-9
) -> dict[str, float]:
    """On pairs of steps from the same true state (same group) whose A* differ: the share whose
    advantages are ordered as their A* (a tie in the advantage counts 1/2), and the share of ties.

    This is the comparison a step baseline exists for: two actions taken in one state.
    """
    adv, star = np.asarray(advantage, float), np.asarray(a_star, float)
    key = np.asarray(group, np.int64) * (int(np.max(state)) + 1 if len(state) else 1) + np.asarray(state, np.int64)
    agree = ties = total = 0.0
    for members in _members(key):
        if len(members) < 2:
            continue
        a, s = adv[members], star[members]
        ds = s[:, None] - s[None, :]
        da = a[:, None] - a[None, :]
        upper = np.triu(np.abs(ds) > tol, 1)
        total += upper.sum()
        tie = upper & (np.abs(da) <= tol)
        ties += tie.sum()
        agree += (upper & ~tie & (np.sign(da) == np.sign(ds))).sum()
    if not total:
        return {"sign_agreement": math.nan, "tie_rate": math.nan, "pairs": 0}
    return {"sign_agreement": float((agree + 0.5 * ties) / total), "tie_rate": float(ties / total), "pairs": int(total)}


def cell_means(values: Sequence[float], cell: Sequence[int]) -> np.ndarray:
    """Each step's cell mean of `values` (the grouped value proxy V̂(s) = mean_C R, docs/concepts/math.md#gae)."""
    values, cell = np.asarray(values, float), np.asarray(cell, np.int64)
    sums = np.bincount(cell, weights=values)
    counts = np.bincount(cell)
    return sums[cell] / counts[cell]


def value_error(proxy: Sequence[float], v_star: Sequence[float], shared: Sequence[bool] | None = None) -> dict[str, float]:
    """RMSE and mean error (bias) of a value proxy against V*, over the steps in `shared` (default all)."""
    p, v = np.asarray(proxy, float), np.asarray(v_star, float)
    if shared is not None:
        mask = np.asarray(shared, bool)
        p, v = p[mask], v[mask]
    if not len(p):
        return {"rmse": math.nan, "bias": math.nan, "n": 0}
    err = p - v
    return {"rmse": float(np.sqrt(np.mean(err**2))), "bias": float(np.mean(err)), "n": int(len(p))}


def _members(key: np.ndarray) -> list[np.ndarray]:
    order = np.argsort(key, kind="stable")
    _, starts = np.unique(key[order], return_index=True)
    return np.split(order, starts[1:])


def _pairs(counts: Counter) -> int:
    return sum(n * (n - 1) // 2 for n in counts.values())


def grouping_quality(cell: Sequence[int], state: Sequence[int], group: Sequence[int]) -> dict[str, float]:
    """A partition (cells) against the true state, pairs counted within task groups.

    singleton_rate: share of steps alone in their cell.
    purity: share of same-cell pairs that share the true state (1: never merges different states).
    split_rate: share of same-true-state pairs put in different cells (0: never splits a state).
    """
    cell, state, group = (np.asarray(x, np.int64) for x in (cell, state, group))
    cells = Counter(zip(group.tolist(), cell.tolist()))
    states = Counter(zip(group.tolist(), state.tolist()))
    both = Counter(zip(group.tolist(), cell.tolist(), state.tolist()))
    same_cell, same_state, same_both = _pairs(cells), _pairs(states), _pairs(both)
    alone = sum(1 for key in zip(group.tolist(), cell.tolist()) if cells[key] == 1)
    return {
        "singleton_rate": alone / max(len(cell), 1),
        "purity": same_both / same_cell if same_cell else math.nan,
        "split_rate": 1.0 - same_both / same_state if same_state else math.nan,
        "cells": len(cells),
        "steps": len(cell),
    }


def distance_separation(hidden: np.ndarray, state: Sequence[int], group: Sequence[int]) -> dict[str, float]:
    """How well cosine distance between hidden states separates same-state from different-state
    pairs (within task groups), whatever ε: the medians of both, and the AUC, the probability
    that a same-state pair is closer than a different-state pair (ties ½; 0.5 = no signal).
    """
    x = np.asarray(hidden, np.float64)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30)
    state, group = np.asarray(state, np.int64), np.asarray(group, np.int64)
    same, different = [], []
    for members in _members(group):
        d = 1.0 - x[members] @ x[members].T
        upper = np.triu(np.ones_like(d, dtype=bool), 1)
        equal = state[members][:, None] == state[members][None, :]
        same.append(d[upper & equal])
        different.append(d[upper & ~equal])
    same, different = np.concatenate(same), np.concatenate(different)
    if not len(same) or not len(different):
        return {"auc": math.nan, "same_median": math.nan, "different_median": math.nan}
    auc = stats.mannwhitneyu(different, same).statistic / (len(same) * len(different))
    return {"auc": float(auc), "same_median": float(np.median(same)), "different_median": float(np.median(different))}
