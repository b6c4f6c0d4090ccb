"""Why BiPACE_Q does or does not beat GiGPO in the TextCraft surface study: its step signal on the study's own policy.

    OMP_NUM_THREADS=1 python -m studies.surface_why.study --warm-start outputs/learning_textcraft_surface/textcraft/warm
    python -m studies.surface_why.study --report studies/surface_why/results/surface_why.json

The learning study (`studies.learning.study --size cpu-textcraft-surface --set train_tasks=8`) trains
one policy shape from one warm start; the oracle rows of `studies/oracle/variation.py` measured
BiPACE_Q's grouping on a *random-init* model of that shape and SmolLM2. This script measures it on
the study's warm start itself (the policy every run of the study starts from, whose hidden states
BiPACE_Q clusters at step 1), on oracle batches (`studies/oracle/truth.py`) of the study's training
goals, turn budget (10) and discount: the behaviour policy takes the expert's action with
probability p, so the batch has A* per step. p = 0.3 wins about as often as the warm start does on
its training goals (0.4), so GRPO's episode term is alive, as in the study; p = 0.7 wins every
episode (the episode term is 0 and only a step term carries a signal, as in `oracle_variation`).

Per batch (variation level, p, seed), the three knobs of BiPACE_Q's partition, one at a time
around the study's settings (layer `cluster_layer` = -2 of 4, history 1, ε calibrated to 20%
singletons):
- `layer`: each decoder layer's output at the last prompt token;
- `history`: the prompts built with 0, 1 (the study's) or 2 earlier steps; the episodes are the same
  (the behaviour policy does not read the prompt, checked), only the text the states come from differs;
- `target`: the singleton rate ε is calibrated to (the trainer's `cluster_eps="auto"` with another
  `target_singleton_rate`): the trainer's own bisection and cap (`max_cluster_eps`), so the study's
  row has the ε its runs calibrate; a row whose ε reached the cap says so (`at_cap`).
and for each: the grouping against the true state (singletons, purity, split), the Spearman of the
step term alone (w_ep = 0) with A*, and the Spearman of the full advantage (the study's settings,
`BiPACEConfig.estimator`) with A*. Two controls bound what a partition can do: `true`, the same
estimator over the true states' cells, and `random`, the hidden cells' sizes dealt to random steps
of each task group (`draws` times): as much grouping as the clusters, and no information.

Writes <out>/surface_why.json (after every batch) and prints the markdown tables of docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import pickle
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import common
from studies.learning.plan import SIZES, rl_config
from studies.oracle.metrics import correlations, grouping_quality
from studies.oracle.study import GAMMA, HiddenStates, step_batch, task_ids
from studies.oracle.truth import TRUTH, TruthBatch, truth_rollouts
from bipace_trainer.advantages import BatchLayout, calibrate_eps, estimate_advantages, factorize, hidden_partition

__all__ = ["WhyPlan", "PLANS", "run", "tables"]

STUDY = "cpu-textcraft-surface"  # the learning study this explains (its env, policy shape, settings)
PRESETS = ("grpo", "gigpo", "bipace_q")


@dataclass(frozen=True)
class WhyPlan:
    tasks: int = 4  # the study's first training goals (it trains on 8, two per step)
    group_size: int = 8
    max_turns: int = 10  # the study's turn budget
    expert_probs: tuple[float, ...] = (0.3, 0.7)
    seeds: tuple[int, ...] = (0, 1, 2)
    levels: tuple[float, ...] = (0.0, 1.0)
    histories: tuple[int, ...] = (0, 1, 2)
    layers: tuple[int, ...] = (-4, -3, -2, -1)
    targets: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4, 0.6)
    draws: int = 20  # random partitions per row


PLANS = {
    "full": WhyPlan(),
    "ci": WhyPlan(tasks=2, group_size=4, expert_probs=(0.3,), seeds=(0,), histories=(0, 1), layers=(-2, -1),
                  targets=(0.2, 0.6), draws=3),
}


@dataclass(frozen=True)
class Study:
    """What the learning study fixes: the estimator settings per preset, the layer and history it clusters with."""

    settings: dict[str, Any]
    layer: int
    history: int
    target: float

    @classmethod
    def load(cls, work_dir: Path) -> Study:
        size = SIZES[STUDY]
        plan = size.envs["textcraft"]
        settings = {p: rl_config(plan, size, work_dir, work_dir / p, preset=p).estimator for p in PRESETS}
        return cls(settings, size.cluster_layer, size.history_length, settings["bipace_q"].target_singleton_rate)


# ---------------------------------------------------------------------- batches


def batches(plan: WhyPlan, level: float, p: float, seed: int, work_dir: Path) -> dict[int, TruthBatch]:
    """The batch of (level, p, seed) with its prompts built at each history length; the same episodes."""
    ids = task_ids("textcraft", plan.tasks, {})
    out = {}
    for history in plan.histories:
        path = work_dir / f"why_{plan.tasks}x{plan.group_size}_t{plan.max_turns}_v{level}_p{p}_s{seed}_h{history}.pkl"
        if not path.exists():
            batch = truth_rollouts("textcraft", ids, group_size=plan.group_size, expert_prob=p, max_turns=plan.max_turns,
                                   seed=seed, gamma=GAMMA, history_length=history, truth=TRUTH["textcraft"](),
                                   env_kwargs={"surface_variation": level, "surface_seed": seed})
            path.write_bytes(pickle.dumps(batch))
        out[history] = pickle.loads(path.read_bytes())
    first = next(iter(out.values()))
    for history, batch in out.items():  # only the prompts may differ between history lengths
        same = [(s.traj, s.t, t.state, t.a_star) for s, t in zip(batch.rollout.steps, batch.truth)]
        if same != [(s.traj, s.t, t.state, t.a_star) for s, t in zip(first.rollout.steps, first.truth)]:
            raise RuntimeError(f"history {history} played other episodes than history {plan.histories[0]}")
    return out


# ---------------------------------------------------------------------- measures


def random_cells(cell: np.ndarray, group: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`cell`'s labels dealt to random steps within each task group: the same cell sizes, no information."""
    out = cell.copy()
    for g in np.unique(group):
        members = np.flatnonzero(group == g)
        out[members] = cell[rng.permutation(members)]
    return out


def _spearman(advantage: torch.Tensor, a_star: np.ndarray) -> float:
    adv = advantage.double().numpy()
    return math.nan if np.all(np.abs(adv) < 1e-12) else correlations(adv, a_star)["spearman"]


def _over_cells(batch, cells: np.ndarray, settings) -> torch.Tensor:
    """The advantage of `settings` with its partition replaced by `cells` (an exact anchor per cell)."""
    anchored = step_batch(batch, anchor=[f"cell {c}" for c in cells])
    return estimate_advantages(anchored, dataclasses.replace(settings, step_partition="hash")).advantage


@dataclass(frozen=True)
class Truth:
    """Per step of a batch: A*, the true state (an id within its task group) and the task group."""

    a_star: np.ndarray
    state: np.ndarray
    group: np.ndarray

    @classmethod
    def of(cls, batch: TruthBatch) -> Truth:
        steps = batch.rollout.steps
        return cls(np.array([t.a_star for t in batch.truth]),
                   factorize([(s.group, t.state) for s, t in zip(steps, batch.truth)]).numpy(),
                   np.array([s.group for s in steps]))


def measure(batch: TruthBatch, truth: Truth, hidden: torch.Tensor, target: float, study: Study, draws: int,
            seed: int) -> dict[str, Any]:
    """One partition (`hidden` at the ε of `target`): grouping, step-term and full-advantage Spearman, and its controls."""
    a_star, group = truth.a_star, truth.group
    plain = step_batch(batch, hidden=hidden)
    layout = BatchLayout.from_batch(plain)
    full = study.settings["bipace_q"]
    eps = calibrate_eps(hidden, layout, target, full.max_cluster_eps)  # as the trainer's cluster_eps="auto"
    cells = hidden_partition(hidden, layout, eps).cell.numpy()
    step_only = dataclasses.replace(full, w_ep=0.0)
    rng = np.random.default_rng(seed)
    shuffled = [random_cells(cells, group, rng) for _ in range(draws)]
    return {
        "eps": eps,
        "at_cap": eps >= full.max_cluster_eps,
        "grouping": grouping_quality(cells, truth.state, group),
        "step": _spearman(estimate_advantages(plain, step_only, cluster_eps=eps).advantage, a_star),
        "full": _spearman(estimate_advantages(plain, full, cluster_eps=eps).advantage, a_star),
        "random_step": _nanmean([_spearman(_over_cells(batch, c, step_only), a_star) for c in shuffled]),
        "random_full": _nanmean([_spearman(_over_cells(batch, c, full), a_star) for c in shuffled]),
    }


def _nanmean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.fmean(values) if values else math.nan


def baselines(batch: TruthBatch, truth: Truth, study: Study) -> dict[str, Any]:
    """GRPO's and GiGPO's advantage (the study's settings) and BiPACE_Q's estimator over the true cells."""
    a_star, state = truth.a_star, truth.state
    anchor = factorize([s.anchor for s in batch.rollout.steps]).numpy()
    plain = step_batch(batch)
    full = study.settings["bipace_q"]
    return {
        "grpo": _spearman(estimate_advantages(plain, study.settings["grpo"]).advantage, a_star),
        "gigpo": _spearman(estimate_advantages(plain, study.settings["gigpo"]).advantage, a_star),
        "true_step": _spearman(_over_cells(batch, state, dataclasses.replace(full, w_ep=0.0)), a_star),
        "true_full": _spearman(_over_cells(batch, state, full), a_star),
        "steps": len(a_star),
        "success": statistics.fmean(e.won for e in batch.rollout.episodes),
        "hash_singletons": grouping_quality(anchor, state, truth.group)["singleton_rate"],
    }


def knob_settings(plan: WhyPlan, study: Study) -> list[tuple[str, int, int, float]]:
    """(knob, layer, history, target): each knob swept with the other two at the study's values."""
    rows = [("layer", layer, study.history, study.target) for layer in plan.layers]
    rows += [("history", study.layer, h, study.target) for h in plan.histories if h != study.history]
    rows += [("target", study.layer, study.history, t) for t in plan.targets if t != study.target]
    return rows


# ---------------------------------------------------------------------- the run


def checkpoint_key(folder: Path) -> str:
    """A short key of a checkpoint folder's files (names, sizes, modification times): a retrained warm start
    at the same path gets a new key, so its hidden states are never read from another model's cache."""
    files = sorted(f for f in folder.iterdir() if f.is_file())
    listing = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return hashlib.sha1(repr((str(folder.resolve()), listing)).encode()).hexdigest()[:12]


def run(plan: WhyPlan, warm_start: Path, out: Path, work_dir: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from bipace_trainer.models import load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    study = Study.load(work_dir)
    if study.history not in plan.histories or study.layer not in plan.layers:
        raise ValueError(f"the plan must include the study's history ({study.history}) and layer ({study.layer})")
    model = AutoModelForCausalLM.from_pretrained(str(warm_start), dtype=torch.float32)
    cache = work_dir / f"why_hidden_{checkpoint_key(warm_start)}.pt"  # states are cached by prompt: one file per model
    capture = HiddenStates(model, load_tokenizer(str(warm_start)), plan.layers, cache, batch_size=16)
    result: dict[str, Any] = {
        "plan": asdict(plan), "warm_start": str(warm_start), "machine": common.machine(),
        "study": {"size": STUDY, "layer": study.layer, "history": study.history, "target": study.target},
        "batches": [],
    }
    path = out / "surface_why.json"
    start_all = time.perf_counter()
    for level in plan.levels:
        for p in plan.expert_probs:
            for seed in plan.seeds:
                start = time.perf_counter()
                by_history = batches(plan, level, p, seed, work_dir)
                states = {h: capture([t.messages for t in b.truth]) for h, b in by_history.items()}
                truth = Truth.of(by_history[study.history])  # the same at every history length (checked in `batches`)
                entry = {"variation": level, "expert_prob": p, "seed": seed,
                         **baselines(by_history[study.history], truth, study), "rows": []}
                for knob, layer, history, target in knob_settings(plan, study):
                    row = measure(by_history[history], truth, states[history][layer], target, study, plan.draws, seed)
                    entry["rows"].append({"knob": knob, "layer": layer, "history": history, "target": target, **row})
                entry["seconds"] = time.perf_counter() - start
                result["batches"].append(entry)
                result["seconds_total"] = time.perf_counter() - start_all
                common.write_json(path, result)
                print(f"v {level} p {p} seed {seed}: {entry['steps']} steps, {entry['seconds']:.0f} s", flush=True)
    return result


# ---------------------------------------------------------------------- report


def _stat(values: list[float], empty: str = "all 0") -> str:
    """Mean ± std over seeds; NaN values (an all-zero advantage, or purity without a shared cell) left out."""
    s = common.mean_std([v for v in values if not math.isnan(v)])
    if not s["n"]:
        return empty
    return f"{s['mean']:.2f}" if s["n"] == 1 else f"{s['mean']:.2f} ± {s['std']:.2f}"


def _cells(result: dict[str, Any]) -> dict[tuple[float, float], list[dict[str, Any]]]:
    cells: dict[tuple[float, float], list[dict[str, Any]]] = {}
    for b in result["batches"]:
        cells.setdefault((b["variation"], b["expert_prob"]), []).append(b)
    return dict(sorted(cells.items()))


def _rows(batches: list[dict[str, Any]], layer: int, history: int, target: float) -> list[dict[str, Any]]:
    """Each batch's row at one (layer, history, target): a setting is measured once per batch."""
    return [r for b in batches for r in b["rows"] if (r["layer"], r["history"], r["target"]) == (layer, history, target)]


def _triple(rows: list[dict[str, Any]], batches: list[dict[str, Any]], term: str) -> str:
    """`term` ("step" or "full") Spearman: hidden cells / the same sizes at random / the true cells."""
    return " / ".join((_stat([r[term] for r in rows]), _stat([r[f"random_{term}"] for r in rows]),
                       _stat([b[f"true_{term}"] for b in batches])))


def tables(result: dict[str, Any]) -> str:
    s, plan = result["study"], result["plan"]
    head = (f"**Full advantage against A\\*** (Spearman, mean ± std over seeds; BiPACE_Q at the study's settings: "
            f"layer {s['layer']}, history {s['history']}, {s['target']:.0%} singletons)")
    lines = [head, "", "| variation | p | success | hash singletons | grpo | gigpo | bipace_q / its cells at random / "
             "its estimator over the true states |", "|---|---|---|---|---|---|---|"]
    for (level, p), bs in _cells(result).items():
        lines.append(f"| {level} | {p} | {_stat([b['success'] for b in bs])} | {_stat([b['hash_singletons'] for b in bs])} | "
                     f"{_stat([b['grpo'] for b in bs])} | {_stat([b['gigpo'] for b in bs])} | "
                     f"{_triple(_rows(bs, s['layer'], s['history'], s['target']), bs, 'full')} |")
    lines += ["", "**BiPACE_Q's partition, one knob at a time** (the others at the study's values; Spearman with A\\* of "
              "the step term alone (w_ep = 0) and of the full advantage, each as hidden cells / the same cell sizes "
              "dealt at random / the true states' cells)", "",
              "| variation | p | knob | value | ε | singletons / purity / split | step term | full advantage |",
              "|---|---|---|---|---|---|---|---|"]
    for (level, p), bs in _cells(result).items():
        sweeps = [("layer", v, (v, s["history"], s["target"])) for v in plan["layers"]]
        sweeps += [("history", v, (s["layer"], v, s["target"])) for v in plan["histories"]]
        sweeps += [("target", v, (s["layer"], s["history"], v)) for v in plan["targets"]]
        for knob, value, setting in sweeps:
            rows = _rows(bs, *setting)
            if not rows:
                continue
            g = [r["grouping"] for r in rows]
            grouping = " / ".join(_stat([x[k] for x in g], "–") for k in ("singleton_rate", "purity", "split_rate"))
            lines.append(f"| {level} | {p} | {knob} | {value} | {statistics.fmean(r['eps'] for r in rows):.2g} | {grouping} | "
                         f"{_triple(rows, bs, 'step')} | {_triple(rows, bs, 'full')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm-start", type=Path, help="the study's warm start (<work-dir>/textcraft/warm of its run)")
    parser.add_argument("--plan", choices=sorted(PLANS), default="full")
    parser.add_argument("--out", type=Path, default=common.ROOT / "studies" / "surface_why" / "results")
    parser.add_argument("--work-dir", type=Path, default=common.ROOT / "outputs" / "surface_why")
    parser.add_argument("--report", type=Path, help="print the tables of a finished run's JSON")
    args = parser.parse_args()
    if args.report:
        print(tables(json.loads(args.report.read_text())))
        return
    if args.warm_start is None or not (args.warm_start / "config.json").exists():
        parser.error(f"--warm-start {args.warm_start}: give the study's warm-start folder (it has config.json); "
                     "`studies.learning.study --size cpu-textcraft-surface` trains it into <work-dir>/textcraft/warm")
    print(tables(run(PLANS[args.plan], args.warm_start, args.out, args.work_dir)))


if __name__ == "__main__":
    main()
