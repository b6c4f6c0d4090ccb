"""Estimator accuracy against an oracle, and grouping quality against the true state (no GPU, no training).

    OMP_NUM_THREADS=1 python -m studies.oracle.study --env textcraft   # full size, one env per process
    OMP_NUM_THREADS=1 python -m studies.oracle.study --env alfworld    # (~45 min together on a loaded 2-core machine)
    OMP_NUM_THREADS=1 python -m studies.oracle.study --size ci         # CI size (~40 s of CPU, tiny random model)
    OMP_NUM_THREADS=1 python -m studies.oracle.study --size hierarchy --env textcraft   # HGPO rows, no hidden states
    OMP_NUM_THREADS=1 python -m studies.oracle.study --size evidence --out studies/oracle/results/beacon   # issue 58's rows
    python -m studies.oracle.study --report studies/oracle/results/oracle_study_*.json   # tables and plots of finished runs
    OMP_NUM_THREADS=1 python -m studies.oracle.study --env textcraft --variation 0 0.5 1   # surface-variation rows
                                                                                    # (studies/oracle/variation.py)

1. Rollouts with known truth (`oracle_truth.py`). G rollouts per task, as in training, on
   TextCraft and ALFWorld (official games when $ALFWORLD_DATA has them, else generated ones),
   played by the trainer's `run_rollouts` with a scripted behaviour policy: the env's expert
   action with probability p, else a random admissible (ALFWorld) or plausible (TextCraft)
   command; several p. Per step: the prompt
   the trainer builds, the true state (TextCraft goal + inventory, ALFWorld's PDDL facts),
   the action, reward, done.
2. Oracle values V*, Q*, A* = Q* - V* under the training discount (0.95) and turn budget
   (TextCraft 30, ALFWorld 50, as in recipes/), from the envs' solvers.
3. Estimator accuracy, on the same rollouts: every preset of `bipace_trainer.advantages`
   (hidden presets only on the batches that have hidden states), and the two axes apart:
   partition {hash, hidden, true state} x baseline {mean, pace_q, pace_diff, gae} with
   w_ep = 0. Spearman and Pearson correlation of the step advantage with A*; sign agreement
   on pairs of steps from the same true state whose A* differ; RMSE of the value proxy
   V̂ = mean_C R (the cell mean of step returns every baseline compares with) against V*.
   Mean and std over rollout seeds.
   HGPO's hierarchy (`context_levels` K = 2, docs/concepts/math.md#hgpo) over each partition,
   with its own level advantage (`{partition}/hierarchy`) and with PACE-Q's
   (`{partition}/hierarchy_pace_q`), beside the same partitions without it.
4. Context consistency (`context`): how often two steps of one exact-anchor cell differ in
   their K = 2 context (the last three anchors), and the grouping quality of the
   context cells against the true state, beside the anchor cells'.
5. Grouping quality of the `hash` partition and of the `hidden` partition of the embedded
   SmolLM2-135M (layers -24, -18, -12, -8 of 30; the calibrated ε of `calibrate_eps` with
   the trainer's defaults, and an ε sweep), with a random-init model of the same shape as a
   control: singleton rate, purity (same-cell pairs that share the true state) and split
   rate (same-state pairs in different cells), within task groups.

Cost is dominated by the hidden states (one forward pass per distinct prompt, ~2 s of CPU for a
~430-token prompt; passes stop at the deepest layer used) and ALFWorld's engine and planner.
Hidden states are computed only for the (seed, p) batches a size lists in `hidden` (pretrained)
and `control` (random init): scale with those lists, `seeds` and `tasks` in `SIZES`. Hidden
states are cached by prompt, and each batch's episodes by (env, tasks, seed, p), under
--work-dir: a rerun only computes what is new (delete the work dir to replay).

Writes <out>/oracle_study.json (oracle_study_<env>.json with --env; rewritten after every batch),
<out>/oracle_accuracy.png and <out>/oracle_grouping.png (with an _<env> suffix under --env; --report
draws them for all the JSON it is given), and prints the markdown tables of docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pickle
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import common
from studies.oracle.metrics import (cell_means, correlations, distance_separation, grouping_quality, pair_sign_agreement,
                                    value_error)
from studies.oracle.truth import TRUTH, TruthBatch, truth_rollouts
from bipace_trainer.advantages import (
    PRESETS,
    BatchLayout,
    StepBatch,
    calibrate_eps,
    context_partition,
    estimate_advantages,
    factorize,
    hash_partition,
    hidden_partition,
    resolve_settings,
)
from bipace_trainer.rollout.hidden import PositionCapture, num_hidden_layers, resolve_layer_module
from bipace_trainer.rollout.prompting import fit_prompt_ids
from envs.base import resolve_env_class, stratified_subset
from envs.surface import check_level

GAMMA = 0.95  # docs/concepts/math.md#paper-setups and every recipe's step_gamma
PAPER_SINGLETONS = {"hash": 0.273, "hidden": 0.180}  # BiPACE paper, ALFWorld, Qwen2.5-7B
BASELINES = ("mean", "pace_q", "pace_diff", "gae")
PARTITIONS = ("hash", "hidden", "true")
CONTEXT_LEVELS = 2  # HGPO's K in its public scripts (= the prompts' history window)
HIERARCHY_LEVEL_BASELINES = {"hierarchy": "mean", "hierarchy_pace_q": "pace_q"}
# PACE-Q with evidence (docs/concepts/math.md#pace-evidence) beside plain PACE-Q on the same cells: the candidate
# for bipace_q's default, κ = 1, written down before the run (docs/results/beacon.md), and two variants
EVIDENCE = {
    "pace_q_evidence1": dict(pace_evidence=1.0),
    "pace_q_evidence2": dict(pace_evidence=2.0),
    "pace_q_gate": dict(pace_variance_gate=True),
}
EVIDENCE_CANDIDATE = "pace_q_evidence1"
# BEACON's milestone return over its segment cells and over state cells (docs/concepts/math.md#milestones)
MILESTONE_CELLS = {"segment": "segment", "hash": "hash", "true": "hash"}
EPS_SWEEP = (0.0, 1e-5, 3e-5, 1e-4, 3e-4, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3)


@dataclass(frozen=True)
class EnvSize:
    tasks: int
    max_turns: int
    group_size: int = 8
    expert_probs: tuple[float, ...] = (0.5, 0.7, 0.9)
    seeds: tuple[int, ...] = (0, 1, 2)
    hidden: tuple[tuple[int, float], ...] = ()  # (seed, p) batches that get pretrained hidden states
    control: tuple[tuple[int, float], ...] = ()  # ... and random-init ones
    env_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Size:
    envs: dict[str, EnvSize]
    model: str = "embedded"  # "tiny": a 64 x 2 random Qwen2 with SmolLM2's tokenizer (CI)
    layers: tuple[int, ...] = (-24, -18, -12, -8)
    accuracy_layer: int = -12  # cluster_layer of the hidden presets (the recipes' value)
    batch_size: int = 4


SIZES = {
    "full": Size(
        envs={
            "textcraft": EnvSize(
                tasks=2,
                max_turns=30,
                expert_probs=(0.2, 0.5, 0.7, 0.9),
                seeds=(0, 1, 2, 3, 4),
                hidden=((0, 0.7), (1, 0.7), (2, 0.7)),
                control=((0, 0.7), (1, 0.7), (2, 0.7)),
            ),
            "alfworld": EnvSize(
                tasks=2,
                max_turns=50,
                seeds=(0, 1),
                hidden=((0, 0.7), (1, 0.7)),
                control=((0, 0.7), (1, 0.7)),
                env_kwargs={"source": "auto"},  # official games when $ALFWORLD_DATA has them
            ),
        }
    ),
    # Issue 58's rows (BEACON, PACE-Q with evidence; docs/results/beacon.md): the "full" batches and their
    # pretrained hidden states at the presets' layer only, no random-init control and no ε sweep over layers
    "evidence": Size(
        envs={
            "textcraft": EnvSize(
                tasks=2, max_turns=30, expert_probs=(0.2, 0.5, 0.7, 0.9), seeds=(0, 1, 2, 3, 4),
                hidden=((0, 0.7), (1, 0.7), (2, 0.7)),
            ),
            "alfworld": EnvSize(
                tasks=2, max_turns=50, seeds=(0, 1), hidden=((0, 0.7), (1, 0.7)), env_kwargs={"source": "auto"},
            ),
        },
        layers=(-12,),
    ),
    # HGPO's rows (context consistency, accuracy with and without the hierarchy) without the
    # hidden-state forward passes that dominate "full": hash and true-state partitions only
    "hierarchy": Size(
        envs={
            "textcraft": EnvSize(tasks=4, max_turns=30, expert_probs=(0.5, 0.7, 0.9), seeds=(0, 1, 2, 3, 4)),
            "alfworld": EnvSize(
                tasks=2, max_turns=50, expert_probs=(0.5, 0.7, 0.9), seeds=(0, 1, 2, 3), env_kwargs={"source": "auto"}
            ),
        }
    ),
    "ci": Size(
        envs={
            "textcraft": EnvSize(
                tasks=2,
                max_turns=30,
                group_size=4,
                expert_probs=(0.5, 0.9),
                seeds=(0, 1),
                hidden=((0, 0.5),),
                control=((0, 0.5),),
            ),
            "alfworld": EnvSize(
                tasks=1,
                max_turns=50,
                group_size=2,
                expert_probs=(0.5,),
                seeds=(0,),
                hidden=((0, 0.5),),
                env_kwargs={"source": "generated"},
            ),
        },
        model="tiny",
        layers=(1, -1),
        accuracy_layer=-1,
    ),
}


# ---------------------------------------------------------------------- hidden states


class _Stop(Exception):
    """Raised by a hook once the deepest layer needed has run: the rest of the pass is skipped."""


class HiddenStates:
    """Hidden states at the last prompt token of the trainer's prompts, at several layers,
    through the project's `PositionCapture` (one forward pass per distinct prompt, cached)."""

    def __init__(self, model, tokenizer, layers: tuple[int, ...], cache_path: Path | None, batch_size: int):
        self.model, self.tokenizer, self.layers, self.batch_size = model.eval(), tokenizer, layers, batch_size
        self.cache_path = cache_path
        self.cache: dict[str, torch.Tensor] = torch.load(cache_path) if cache_path and cache_path.exists() else {}
        # seconds each cached state cost when it was computed (its forward batch's time / its size), so a
        # rerun from the cache still reports what the hidden states of a batch cost
        self.cost_path = cache_path.with_suffix(".seconds.json") if cache_path else None
        self.cost: dict[str, float] = json.loads(self.cost_path.read_text()) if self.cost_path and self.cost_path.exists() else {}
        count = num_hidden_layers(model)
        self.deepest = max(layer % (count + 1) for layer in layers)
        self.stop_early = self.deepest < count  # past the last decoder layer only the final norm is left
        context = getattr(model.config, "max_position_embeddings", 8192)
        self.limit = max(context - 512, 16)  # as the trainer bounds prompts (its max_completion_length: 512)
        self.seconds = 0.0
        self.computed = 0

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return fit_prompt_ids(self.tokenizer(text, add_special_tokens=False).input_ids, self.limit)

    def __call__(self, prompts: list[list[dict[str, str]]]) -> dict[int, torch.Tensor]:
        ids = [self.prompt_ids(messages) for messages in prompts]
        keys = [hashlib.sha1(str(row).encode()).hexdigest() for row in ids]
        todo = sorted({key: row for key, row in zip(keys, ids) if key not in self.cache}.items(), key=lambda kv: len(kv[1]))
        start = time.perf_counter()
        for b in range(0, len(todo), self.batch_size):
            chunk = todo[b : b + self.batch_size]
            chunk_start = time.perf_counter()
            states = self._forward([row for _, row in chunk])
            for j, (key, _) in enumerate(chunk):
                self.cache[key] = torch.stack([states[layer][j] for layer in self.layers])
                self.cost[key] = (time.perf_counter() - chunk_start) / len(chunk)
            if self.cache_path and (b // self.batch_size) % 8 == 7:  # a killed run keeps what it computed
                self._save()
                print(f"  hidden states: {b + len(chunk)}/{len(todo)} prompts, {time.perf_counter() - start:.0f} s", flush=True)
        self.seconds += time.perf_counter() - start
        self.computed += len(todo)
        if todo and self.cache_path:
            self._save()
        distinct = dict(zip(keys, ids))
        self.last = {
            "distinct_prompts": len(distinct),
            "prompts_computed": len(todo),
            "seconds_now": time.perf_counter() - start,
            "seconds_to_compute": sum(self.cost.get(key, math.nan) for key in distinct),
            "mean_prompt_tokens": statistics.fmean(map(len, distinct.values())),
        }
        stacked = torch.stack([self.cache[key] for key in keys])  # (N, layers, d)
        return {layer: stacked[:, i] for i, layer in enumerate(self.layers)}

    def _save(self) -> None:
        torch.save(self.cache, self.cache_path)
        self.cost_path.write_text(json.dumps(self.cost))

    @torch.no_grad()
    def _forward(self, rows: list[list[int]]) -> dict[int, torch.Tensor]:
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() does for left padding

        def stop(module, args, output):
            raise _Stop

        with contextlib.ExitStack() as stack:
            captures = {layer: stack.enter_context(PositionCapture(self.model, layer, position=-1)) for layer in self.layers}
            handle = resolve_layer_module(self.model, self.deepest).register_forward_hook(stop) if self.stop_early else None
            try:
                self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
            except _Stop:
                pass
            finally:
                if handle is not None:
                    handle.remove()
        return {layer: capture.states for layer, capture in captures.items()}


def load_models(size: Size):
    """(pretrained, random-init control of the same shape, tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bipace_trainer.models import load_tokenizer, resolve_model_name, tiny_qwen2

    path = resolve_model_name("embedded")
    tokenizer = load_tokenizer(path)
    if size.model == "tiny":
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tiny_qwen2(tokenizer, seed=0), tiny_qwen2(tokenizer, seed=1), tokenizer
    pretrained = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    control = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    return pretrained, control, tokenizer


# ---------------------------------------------------------------------- one batch


def step_batch(batch: TruthBatch, anchor=None, hidden=None) -> StepBatch:
    """The estimator's input as the trainer builds it (`Rollout.step_batch`), with other anchors
    (the true state, for the "true" partition: no next anchor then, the final states have no
    recorded truth, so a failed last step is a dead end) and the hidden states of one layer."""
    records = batch.rollout.step_batch()
    if anchor is None:
        return dataclasses.replace(records, hidden=hidden)
    return dataclasses.replace(records, anchor=anchor, next_anchor=None, anchor_text=None, hidden=hidden)


def oracle_checks(batch: TruthBatch) -> dict[str, Any]:
    """What the oracle says about the behaviour policy's steps (and checks on the oracle itself)."""
    truth = batch.truth
    expert = [t for t in truth if t.took_expert]
    other = [t for t in truth if not t.took_expert]
    distance_by_state: dict[tuple[int, str], set] = {}
    for step, t in zip(batch.rollout.steps, truth):
        distance_by_state.setdefault((step.group, t.state), set()).add(t.distance)
    return {
        "steps": len(truth),
        "expert_steps": len(expert),
        "expert_a_star_zero": sum(abs(t.a_star) < 1e-9 for t in expert) / max(len(expert), 1),
        "random_steps": len(other),
        "random_a_star_negative": sum(t.a_star < -1e-9 for t in other) / max(len(other), 1),
        "a_star_positive": sum(t.a_star > 1e-9 for t in truth),
        "states_with_two_distances": sum(len(d) > 1 for d in distance_by_state.values()),
        "a_star_mean": statistics.fmean(t.a_star for t in truth) if truth else math.nan,
        "v_star_mean": statistics.fmean(t.v_star for t in truth) if truth else math.nan,
    }


def estimator_metrics(estimate, a_star, state_ids, group) -> dict[str, float]:
    adv = estimate.advantage.double().numpy()
    metrics = correlations(adv, a_star)
    metrics.update(pair_sign_agreement(adv, a_star, state_ids, group))
    metrics["zero_rate"] = float(np.mean(np.abs(adv) < 1e-9))
    return metrics


def evaluate_batch(batch: TruthBatch, hidden: dict[str, dict[int, torch.Tensor]], size: Size) -> dict[str, Any]:
    """Estimator accuracy (every preset, every axis pair) and grouping quality on one batch."""
    steps = batch.rollout.steps
    a_star = np.array([t.a_star for t in batch.truth])
    v_star = np.array([t.v_star for t in batch.truth])
    state_ids = factorize([(s.group, t.state) for s, t in zip(steps, batch.truth)]).numpy()
    group = np.array([s.group for s in steps])
    pretrained = hidden.get("pretrained")
    plain = step_batch(batch, hidden=pretrained[size.accuracy_layer] if pretrained else None)
    true_anchor = step_batch(batch, anchor=[t.state for t in batch.truth])
    layout = BatchLayout.from_batch(plain)
    out: dict[str, Any] = {"estimators": {}, "axes": {}, "value_proxy": {}, "grouping": {}}

    q_star = np.array([t.q_star for t in batch.truth])
    for preset in PRESETS:
        settings = resolve_settings(preset)
        if settings.step_partition == "hidden" and pretrained is None:
            continue
        estimate = estimate_advantages(plain, settings)
        out["estimators"][preset] = estimator_metrics(estimate, a_star, state_ids, group)
        # the step return itself against the true Q* (the graph return's accuracy beside the discounted one's)
        out["estimators"][preset]["return_vs_q_star"] = correlations(estimate.step_return.double().numpy(), q_star)

    for partition in PARTITIONS:
        if partition == "hidden" and pretrained is None:
            continue
        source = true_anchor if partition == "true" else plain
        for baseline in BASELINES:
            settings = resolve_settings(
                "gigpo", step_partition="hidden" if partition == "hidden" else "hash", step_baseline=baseline, w_ep=0.0
            )
            estimate = estimate_advantages(source, settings)
            out["axes"][f"{partition}/{baseline}"] = estimator_metrics(estimate, a_star, state_ids, group)
            if baseline == "pace_q":
                for name, evidence in EVIDENCE.items():
                    shrunk = estimate_advantages(source, dataclasses.replace(settings, **evidence))
                    out["axes"][f"{partition}/{name}"] = estimator_metrics(shrunk, a_star, state_ids, group)
            if baseline == "mean":  # the value proxy is the same cell mean for every baseline
                proxy = cell_means(estimate.step_return.numpy(), estimate.cell.numpy())
                shared = np.bincount(estimate.cell.numpy())[estimate.cell.numpy()] > 1
                out["value_proxy"][partition] = {
                    "all": value_error(proxy, v_star),
                    "shared": value_error(proxy, v_star, shared),
                    "singleton_rate": float(1 - shared.mean()),
                }
                out["grouping"][partition] = grouping_quality(estimate.cell.numpy(), state_ids, group)
    out["grouping"]["true"]["singleton_rate_of_truth"] = out["grouping"]["true"]["singleton_rate"]
    for partition in PARTITIONS:  # the same partitions under HGPO's hierarchy (w_ep = 0, as HGPO)
        if partition == "hidden" and pretrained is None:
            continue
        source = true_anchor if partition == "true" else plain
        for name, level_baseline in HIERARCHY_LEVEL_BASELINES.items():
            settings = resolve_settings(
                "hgpo", step_partition="hidden" if partition == "hidden" else "hash", level_baseline=level_baseline,
                context_levels=CONTEXT_LEVELS,
            )  # fmt: skip
            estimate = estimate_advantages(source, settings)
            out["axes"][f"{partition}/{name}"] = estimator_metrics(estimate, a_star, state_ids, group)
    out["context"] = context_consistency(plain, layout, state_ids, group)
    for name, cells in MILESTONE_CELLS.items():  # BEACON's return on its own cells and on state cells, w_ep = 0
        settings = resolve_settings("beacon", step_partition=cells, w_ep=0.0)
        estimate = estimate_advantages(true_anchor if name == "true" else plain, settings)
        out["axes"][f"{name}/milestone"] = estimator_metrics(estimate, a_star, state_ids, group)

    for model, states in hidden.items():
        for layer in size.layers:
            h = states[layer]
            eps = calibrate_eps(h, layout, 0.2, 0.3)  # the trainer's defaults for cluster_eps="auto"
            entry = {"calibrated_eps": eps, "calibrated": _quality(h, layout, eps, state_ids, group)}
            entry["sweep"] = {str(e): _quality(h, layout, e, state_ids, group) for e in EPS_SWEEP}
            entry["separation"] = distance_separation(h.numpy(), state_ids, group)
            out["grouping"][f"hidden/{model}/{layer}"] = entry
    return out


def context_consistency(batch: StepBatch, layout: BatchLayout, state_ids, group, levels: int = CONTEXT_LEVELS) -> dict:
    """How often steps of one exact-anchor cell differ in their K-step context (HGPO's
    "context inconsistency"), and whether the context cells are purer than the anchor cells.

    Pairs are counted within exact-anchor cells: `pairs_differ` is the fraction of same-anchor
    pairs whose context (the anchors of the last K+1 steps, or of the whole history when
    t < K) differs; `steps_differ` the fraction of steps in a shared anchor cell with at
    least one cellmate of another context. `anchor` and `context` are `grouping_quality`
    of the two cellings against the true state.
    """
    anchor = hash_partition(batch.anchor, layout)
    context = context_partition(anchor, layout, levels)
    anchor_cell, context_cell = anchor.cell.numpy(), context.cell.numpy()
    anchor_size = np.bincount(anchor_cell)[anchor_cell]
    context_size = np.bincount(context_cell)[context_cell]
    total_pairs = float(np.sum(anchor.size.numpy() * (anchor.size.numpy() - 1)) / 2)
    same_pairs = float(np.sum(context.size.numpy() * (context.size.numpy() - 1)) / 2)
    shared = anchor_size > 1
    return {
        "levels": levels,
        "steps": int(len(anchor_cell)),
        "steps_in_shared_anchor_cells": int(shared.sum()),
        "anchor_pairs": total_pairs,
        "pairs_differ": 1.0 - same_pairs / total_pairs if total_pairs else math.nan,
        "steps_differ": float(np.mean(context_size[shared] < anchor_size[shared])) if shared.any() else math.nan,
        "anchor": grouping_quality(anchor_cell, state_ids, group),
        "context": grouping_quality(context_cell, state_ids, group),
    }


def _quality(h, layout, eps, state_ids, group) -> dict[str, float]:
    return grouping_quality(hidden_partition(h, layout, eps).cell.numpy(), state_ids, group)


# ---------------------------------------------------------------------- the study


def task_ids(env: str, count: int, env_kwargs: dict[str, Any]) -> list[int]:
    """The first `count` training tasks, spread over task types (ALFWorld) or depths (TextCraft)."""
    env_class = resolve_env_class(env)
    specs = env_class.tasks("train", **env_kwargs)
    return [spec.task_id for spec in stratified_subset(specs, count, env_class.report_key, label=f"{env} tasks")]


def run(size: Size, out: Path, work_dir: Path, only: list[str] | None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    needs_models = any(s.hidden or s.control for s in size.envs.values())
    models = load_models(size) if needs_models else None
    capture = {}
    if models:
        pretrained, control, tokenizer = models
        tag = "_".join([size.model, *(only or [])])
        capture = {
            "pretrained": HiddenStates(
                pretrained, tokenizer, size.layers, work_dir / f"hidden_{tag}_pretrained.pt", size.batch_size
            ),
            "random_init": HiddenStates(control, tokenizer, size.layers, work_dir / f"hidden_{tag}_random.pt", size.batch_size),
        }
    result = {"size": _jsonable(asdict(size)), "machine": common.machine(), "gamma": GAMMA, "batches": []}
    path = out / (f"oracle_study_{'_'.join(only)}.json" if only else "oracle_study.json")
    start_all = time.perf_counter()
    for env, plan in size.envs.items():
        if only and env not in only:
            continue
        ids = task_ids(env, plan.tasks, plan.env_kwargs)
        truth = TRUTH[env]()  # ALFWorld's plans are memoised across batches
        for seed in plan.seeds:
            for p in plan.expert_probs:
                start = time.perf_counter()
                saved = work_dir / f"batch_{env}_{'-'.join(map(str, ids))}_g{plan.group_size}_t{plan.max_turns}_s{seed}_p{p}.pkl"
                if saved.exists():  # episodes are deterministic given the seed: replaying them gives the same batch
                    batch = pickle.loads(saved.read_bytes())
                else:
                    batch = truth_rollouts(
                        env,
                        ids,
                        group_size=plan.group_size,
                        expert_prob=p,
                        max_turns=plan.max_turns,
                        seed=seed,
                        gamma=GAMMA,
                        env_kwargs=plan.env_kwargs,
                        truth=truth,
                    )
                    batch.seconds["rollout"] = time.perf_counter() - start
                    saved.write_bytes(pickle.dumps(batch))
                rollout_seconds = batch.seconds["rollout"]
                hidden, hidden_seconds = {}, {}
                prompts = [t.messages for t in batch.truth]
                for model, wanted in (("pretrained", plan.hidden), ("random_init", plan.control)):
                    if (seed, p) in wanted:
                        hidden[model] = capture[model](prompts)
                        hidden_seconds[model] = capture[model].last
                start = time.perf_counter()
                metrics = evaluate_batch(batch, hidden, size)
                episodes = batch.rollout.episodes
                entry = {
                    "env": env,
                    "seed": seed,
                    "expert_prob": p,
                    "tasks": ids,
                    "success_rate": sum(e.won for e in episodes) / len(episodes),
                    "episode_length": statistics.fmean(e.length for e in episodes),
                    "distinct_prompts": len({str(t.messages) for t in batch.truth}),
                    "oracle": oracle_checks(batch),
                    **metrics,
                    "seconds": {
                        **batch.seconds,
                        "hidden": hidden_seconds,
                        "analysis": time.perf_counter() - start,
                    },
                }
                result["batches"].append(entry)
                result["seconds_total"] = time.perf_counter() - start_all
                common.write_json(path, result)
                print(
                    f"{env} seed {seed} p {p}: {entry['oracle']['steps']} steps, success {entry['success_rate']:.2f}, "
                    f"rollout {rollout_seconds:.0f} s, hidden "
                    + ", ".join(
                        f"{m} {v['prompts_computed']} prompts {v['seconds_now']:.0f} s" for m, v in hidden_seconds.items()
                    ),
                    flush=True,
                )
    result["summary"] = summarise(result["batches"])
    common.write_json(path, result)
    return result


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


# ---------------------------------------------------------------------- summary, tables, plots


def _stat(values: list[float]) -> dict[str, float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return common.mean_std(values) if values else {"mean": math.nan, "std": math.nan, "n": 0}


def summarise(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and std over seeds, per env, p and estimator (presets and axes)."""
    summary: dict[str, Any] = {}
    keys = sorted({(b["env"], b["expert_prob"]) for b in batches})
    for env, p in keys:
        group = [b for b in batches if b["env"] == env and b["expert_prob"] == p]
        entry: dict[str, Any] = {"seeds": len(group), "steps": _stat([b["oracle"]["steps"] for b in group])}
        entry["success_rate"] = _stat([b["success_rate"] for b in group])
        for kind in ("estimators", "axes"):
            names = sorted({name for b in group for name in b[kind]})
            entry[kind] = {
                name: {
                    metric: _stat([b[kind][name][metric] for b in group if name in b[kind]])
                    for metric in ("spearman", "pearson", "sign_agreement", "tie_rate", "zero_rate")
                }
                for name in names
            }
        entry["value_proxy"] = {
            partition: {
                "rmse_all": _stat([b["value_proxy"][partition]["all"]["rmse"] for b in group if partition in b["value_proxy"]]),
                "rmse_shared": _stat(
                    [b["value_proxy"][partition]["shared"]["rmse"] for b in group if partition in b["value_proxy"]]
                ),
            }
            for partition in PARTITIONS
        }
        with_context = [b for b in group if "context" in b]
        if with_context:
            entry["context"] = {
                "pairs_differ": _stat([b["context"]["pairs_differ"] for b in with_context]),
                "steps_differ": _stat([b["context"]["steps_differ"] for b in with_context]),
                **{
                    f"{cells}_{metric}": _stat([b["context"][cells][metric] for b in with_context])
                    for cells in ("anchor", "context")
                    for metric in ("purity", "split_rate", "singleton_rate")
                },
            }
        summary[f"{env}/p={p}"] = entry
    return summary


def _fmt(stat: dict[str, float], digits: int = 2) -> str:
    if stat["n"] == 0 or math.isnan(stat["mean"]):
        return "–"
    if stat["n"] == 1:
        return f"{stat['mean']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"


def tables(result: dict[str, Any]) -> str:
    """The markdown tables of docs/RESULTS.md."""
    lines = []
    summary = result.get("summary") or summarise(result["batches"])
    for env in dict.fromkeys(b["env"] for b in result["batches"]):
        cells = {k: v for k, v in summary.items() if k.startswith(env + "/")}
        probs = [k.split("=")[1] for k in cells]
        lines.append(
            f"\n**{env}: step advantage vs A\\*** (Spearman / sign agreement on same-state pairs; mean ± std over seeds)\n"
        )
        lines.append("| estimator | " + " | ".join(f"p = {p}: Spearman | sign agr." for p in probs) + " |")
        lines.append("|---|" + "---|---|" * len(probs))
        for kind in ("estimators", "axes"):
            names = list(dict.fromkeys(n for c in cells.values() for n in c[kind]))
            for name in names:
                row = []
                for c in cells.values():
                    m = c[kind].get(name)
                    row += [_fmt(m["spearman"]), _fmt(m["sign_agreement"])] if m else ["–", "–"]
                label = name if kind == "estimators" else f"{name} (w_ep=0)"
                lines.append(f"| {label} | " + " | ".join(row) + " |")
        paired = [b for b in result["batches"] if b["env"] == env and "bipace_q" in b["estimators"]]
        if paired:
            names = ("gigpo", "bipace_q", "gagpo", "bigagpo", "hash/pace_q", "hidden/pace_q", "true/pace_q")
            lines.append(f"\n**{env}: paired on the batches with hidden states** (Spearman / sign agreement)\n")
            lines.append("| batch | " + " | ".join(names) + " |")
            lines.append("|---|" + "---|" * len(names))
            for b in paired:
                row = [b["estimators"].get(n) or b["axes"][n] for n in names]
                text = " | ".join(f"{m['spearman']:.2f} / {m['sign_agreement']:.2f}" for m in row)
                lines.append(f"| seed {b['seed']}, p {b['expert_prob']} | {text} |")
        lines += context_table(env, cells)
        lines.append(f"\n**{env}: value proxy mean_C R vs V\\*** (RMSE over all steps / over steps in shared cells)\n")
        lines.append("| partition | " + " | ".join(f"p = {p}" for p in probs) + " |")
        lines.append("|---|" + "---|" * len(probs))
        for partition in PARTITIONS:
            row = [
                f"{_fmt(c['value_proxy'][partition]['rmse_all'], 3)} / {_fmt(c['value_proxy'][partition]['rmse_shared'], 3)}"
                for c in cells.values()
            ]
            lines.append(f"| {partition} | " + " | ".join(row) + " |")
        lines.append(f"\n**{env}: the batches** (oracle checks per batch)\n")
        lines.append(
            "| seed | p | steps | success | expert steps with A\\*=0 | random steps with A\\*<0 | A\\*>0 "
            "| states with two d | rollout s | hidden states s (distinct prompts × mean length) |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for b in (b for b in result["batches"] if b["env"] == env):
            o = b["oracle"]
            hid = (
                ", ".join(
                    f"{m} {v['seconds_to_compute']:.0f} ({v['distinct_prompts']} × {v['mean_prompt_tokens']:.0f} tokens)"
                    for m, v in b["seconds"]["hidden"].items()
                )
                or "–"
            )
            lines.append(
                f"| {b['seed']} | {b['expert_prob']} | {o['steps']} | {b['success_rate']:.2f} | {o['expert_a_star_zero']:.3f} "
                f"| {o['random_a_star_negative']:.3f} | {o['a_star_positive']} | {o['states_with_two_distances']} "
                f"| {b['seconds']['rollout']:.0f} | {hid} |"
            )
        lines.append(f"\n**{env}: grouping quality against the true state** (batches with hidden states)\n")
        lines.append("| batch | partition | ε | singleton rate | purity | split rate | distance AUC (same < different state) |")
        lines.append("|---|---|---|---|---|---|---|")
        for b in (b for b in result["batches"] if b["env"] == env and any(k.startswith("hidden/") for k in b["grouping"])):
            name = f"seed {b['seed']}, p {b['expert_prob']}"
            for partition in ("true", "hash"):
                g = b["grouping"][partition]
                lines.append(
                    f"| {name} | {partition} | – | {g['singleton_rate']:.3f} | {g['purity']:.3f} | {g['split_rate']:.3f} | – |"
                )
            for key, g in b["grouping"].items():
                if key.startswith("hidden/"):
                    q = g["calibrated"]
                    lines.append(
                        f"| {name} | {key} | {g['calibrated_eps']:.2g} | {q['singleton_rate']:.3f} "
                        f"| {q['purity']:.3f} | {q['split_rate']:.3f} | {g.get('separation', {}).get('auc', math.nan):.3f} |"
                    )
    if any(f"hash/{EVIDENCE_CANDIDATE}" in b["axes"] for b in result["batches"]):
        lines += evidence_table(result)
    paper = PAPER_SINGLETONS
    lines.append(
        f"\nPaper (BiPACE, ALFWorld, Qwen2.5-7B): singleton rate hash {paper['hash']:.3f}, hidden {paper['hidden']:.3f}."
    )
    return "\n".join(lines)


def evidence_deltas(result: dict[str, Any], variant: str) -> dict[tuple[str, float, str], dict[str, list[float]]]:
    """Per (env, p, partition): the paired differences `variant` − plain PACE-Q over seeds, per metric."""
    deltas: dict = {}
    for b in result["batches"]:
        for partition in PARTITIONS:
            plain, other = b["axes"].get(f"{partition}/pace_q"), b["axes"].get(f"{partition}/{variant}")
            if plain is None or other is None:
                continue
            entry = deltas.setdefault((b["env"], b["expert_prob"], partition), {"spearman": [], "sign_agreement": []})
            for metric, values in entry.items():
                if not (math.isnan(plain[metric]) or math.isnan(other[metric])):
                    values.append(other[metric] - plain[metric])
    return deltas


def evidence_table(result: dict[str, Any]) -> list[str]:
    """PACE-Q with evidence against plain PACE-Q, paired by seed in every env × p cell and partition, and
    whether the candidate is at least as accurate in every one (the rule for making it bipace_q's default)."""
    lines = ["\n**PACE-Q with evidence − plain PACE-Q, paired by seed** (w_ep = 0; mean [min, max] over seeds)\n"]
    lines.append("| variant | env | p | partition | seeds | Δ Spearman | Δ sign agr. |")
    lines.append("|---|---|---|---|---|---|---|")
    verdicts = {}
    for variant in EVIDENCE:
        deltas = evidence_deltas(result, variant)
        worse = []
        for (env, p, partition), d in sorted(deltas.items(), key=lambda kv: (kv[0][0], kv[0][1], PARTITIONS.index(kv[0][2]))):
            cells = []
            for metric in ("spearman", "sign_agreement"):
                values = d[metric]
                if not values:
                    cells.append("–")
                    continue
                mean = statistics.fmean(values)
                worse += [(env, p, partition, metric, mean)] if mean < 0 else []
                cells.append(f"{mean:+.3f} [{min(values):+.3f}, {max(values):+.3f}]")
            seeds = max(len(d["spearman"]), len(d["sign_agreement"]))
            lines.append(f"| {variant} | {env} | {p} | {partition} | {seeds} | {cells[0]} | {cells[1]} |")
        verdicts[variant] = worse
    for variant, worse in verdicts.items():
        tag = " (the candidate)" if variant == EVIDENCE_CANDIDATE else ""
        if worse:
            listed = ", ".join(f"{env} p {p} {partition} {metric} {mean:+.3f}" for env, p, partition, metric, mean in worse)
            lines.append(f"\n{variant}{tag}: less accurate on average in {len(worse)} cell(s): {listed}.")
        else:
            lines.append(f"\n{variant}{tag}: at least as accurate as plain PACE-Q in every cell, both metrics.")
    return lines


def context_table(env: str, cells: dict[str, Any]) -> list[str]:
    """HGPO's context inconsistency at K = 2 and what the hierarchy does to accuracy, per p."""
    cells = {k: v for k, v in cells.items() if "context" in v}
    if not cells:
        return []
    lines = [
        f"\n**{env}: context inconsistency at K = {CONTEXT_LEVELS}** (exact-anchor cells; mean ± std over seeds)\n",
        "| p | same-anchor pairs that differ in context | steps with a cellmate of another context "
        "| purity anchor → context | split rate anchor → context | singleton rate anchor → context "
        "| Spearman hash/mean → hash/hierarchy | true/mean → true/hierarchy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, c in cells.items():
        x = c["context"]
        axes = c["axes"]

        def arrow(a, b):
            return f"{_fmt(axes[a]['spearman'])} → {_fmt(axes[b]['spearman'])}" if a in axes and b in axes else "–"

        lines.append(
            f"| {key.split('=')[1]} | {_fmt(x['pairs_differ'], 3)} | {_fmt(x['steps_differ'], 3)} "
            f"| {_fmt(x['anchor_purity'], 3)} → {_fmt(x['context_purity'], 3)} "
            f"| {_fmt(x['anchor_split_rate'], 3)} → {_fmt(x['context_split_rate'], 3)} "
            f"| {_fmt(x['anchor_singleton_rate'], 3)} → {_fmt(x['context_singleton_rate'], 3)} "
            f"| {arrow('hash/mean', 'hash/hierarchy')} | {arrow('true/mean', 'true/hierarchy')} |"
        )
    return lines


def plots(result: dict[str, Any], out: Path, suffix: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result.get("summary") or summarise(result["batches"])
    envs = list(dict.fromkeys(b["env"] for b in result["batches"]))
    fig, axes = plt.subplots(len(envs), 1, figsize=(13, 4.2 * len(envs)), squeeze=False)
    for ax, env in zip(axes[:, 0], envs):
        cells = {k.split("=")[1]: v for k, v in summary.items() if k.startswith(env + "/")}
        names = list(dict.fromkeys(n for c in cells.values() for n in c["estimators"]))
        names += [f"axis:{n}" for n in dict.fromkeys(n for c in cells.values() for n in c["axes"])]
        width = 0.8 / max(len(cells), 1)
        for j, (p, c) in enumerate(cells.items()):
            means, stds = [], []
            for name in names:
                kind, key = ("axes", name[5:]) if name.startswith("axis:") else ("estimators", name)
                m = c[kind].get(key, {}).get("spearman", {"mean": math.nan, "std": 0.0})
                means.append(m["mean"])
                stds.append(m["std"] if not math.isnan(m.get("std", 0.0)) else 0.0)
            ax.bar(np.arange(len(names)) + j * width, means, width, yerr=stds, label=f"p = {p}", capsize=2)
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2)
        ax.set_xticklabels([n.replace("axis:", "") for n in names], rotation=60, ha="right", fontsize=8)
        ax.axhline(0, color="black", lw=0.5)
        ax.set_ylabel("Spearman(advantage, A*)")
        ax.set_title(f"{env}: step advantage vs oracle A* (presets, then partition/baseline with w_ep = 0)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"oracle_accuracy{suffix}.png", dpi=110)
    plt.close(fig)

    batches = [b for b in result["batches"] if any(k.startswith("hidden/") for k in b["grouping"])]
    if not batches:
        return
    fig, axes = plt.subplots(len(batches), 2, figsize=(13, 4.2 * len(batches)), squeeze=False)
    for (by_eps, tradeoff), b in zip(axes, batches):
        title = f"{b['env']} seed {b['seed']} p {b['expert_prob']}"
        for key, g in b["grouping"].items():
            if not key.startswith("hidden/"):
                continue
            _, model, layer = key.split("/")
            sweep = list(g["sweep"].values())
            style = dict(marker="o", ms=3, ls="-" if model == "pretrained" else "--", label=f"{model} {layer}")
            by_eps.plot([float(e) for e in g["sweep"]], [q["singleton_rate"] for q in sweep], **style)
            tradeoff.plot([q["split_rate"] for q in sweep], [q["purity"] for q in sweep], **style)
        exact, true = b["grouping"]["hash"], b["grouping"]["true"]
        by_eps.axhline(exact["singleton_rate"], color="black", lw=1.5, label="hash")
        by_eps.axhline(true["singleton_rate"], color="green", lw=1.5, ls=":", label="true state")
        by_eps.axhline(PAPER_SINGLETONS["hash"], color="grey", lw=0.8, ls="-.", label="paper: hash 27.3%, hidden 18.0%")
        by_eps.axhline(PAPER_SINGLETONS["hidden"], color="grey", lw=0.8, ls="-.")
        by_eps.set_xscale("symlog", linthresh=1e-5)
        by_eps.set_xlim(0, 0.35)
        by_eps.set(xlabel="ε (cosine distance)", ylabel="singleton rate", title=f"{title}: singleton rate vs ε")
        by_eps.legend(fontsize=6, ncol=2)
        tradeoff.plot([exact["split_rate"]], [exact["purity"]], "k*", ms=14, label="hash")
        tradeoff.plot([0.0], [1.0], "g^", ms=10, label="true state")
        tradeoff.set(
            xlabel="split rate (same-state pairs in different cells)",
            ylabel="purity (same-cell pairs in one state)",
            title=f"{title}: purity vs split over the ε sweep (ε grows leftwards)",
        )
        tradeoff.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / f"oracle_grouping{suffix}.png", dpi=100)
    plt.close(fig)


def main() -> None:
    if os.environ.get("PYTHONHASHSEED") != "0":
        # TextCraft's task text (the order of its crafting commands) follows the process's string
        # hash seed, so prompts, episodes and hidden states would change from run to run.
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]], {**os.environ, "PYTHONHASHSEED": "0"})
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # "graph" is a --variation size only (variation.VARIATION_SIZES: the graph presets' rows)
    parser.add_argument("--size", choices=sorted({*SIZES, "graph"}), default="full")
    parser.add_argument("--env", nargs="*", help="only these envs (default: all of the size)")
    parser.add_argument("--out", type=Path, default=common.ROOT / "studies" / "oracle" / "results")
    parser.add_argument("--work-dir", type=Path, default=common.ROOT / "outputs" / "oracle")
    parser.add_argument(
        "--report", type=Path, nargs="+", help="print the tables and draw the plots of finished runs' JSON (merged)"
    )
    parser.add_argument(
        "--variation", type=float, nargs="+", metavar="LEVEL",
        help="surface-variation rows instead (studies/oracle/variation.py): the same episodes at these levels, e.g. 0 0.5 1",
    )
    parser.add_argument("--variation-report", type=Path, nargs="+", help="tables and plot of finished variation runs' JSON")
    args = parser.parse_args()
    if args.variation is not None or args.variation_report:
        from studies.oracle import variation as oracle_variation

        if args.variation_report:
            result = oracle_variation.report(args.variation_report)
        else:
            for level in args.variation:
                check_level(level, "--variation")
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
            result = oracle_variation.run_variation(args.size, args.variation, args.out, args.work_dir, args.env)
        print(oracle_variation.variation_tables(result))
        return
    if args.report:
        parts = [json.loads(path.read_text()) for path in args.report]
        batches = [b for part in parts for b in part["batches"]]
        result = {
            "batches": batches,
            "summary": summarise(batches),
            "seconds_total": sum(p.get("seconds_total", 0) for p in parts),
        }
        plots(result, args.report[0].parent)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        result = run(SIZES[args.size], args.out, args.work_dir, args.env)
        plots(result, args.out, f"_{'_'.join(args.env)}" if args.env else "")
    print(tables(result))
    print(f"\ntotal {result.get('seconds_total', 0):.0f} s")


if __name__ == "__main__":
    main()
