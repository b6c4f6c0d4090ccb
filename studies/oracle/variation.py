"""Oracle study rows under surface variation: hash vs hidden-state grouping when the text of a state varies.

    OMP_NUM_THREADS=1 python -m studies.oracle.study --env textcraft --variation 0 1 0.5   # levels run in this order
    OMP_NUM_THREADS=1 python -m studies.oracle.study --env alfworld --variation 0 1 0.5
    OMP_NUM_THREADS=1 python -m studies.oracle.study --size ci --variation 0 1          # CI size (tiny models)
    python -m studies.oracle.study --variation-report studies/oracle/results/oracle_variation_*.json

The same behaviour-policy episodes as `oracle_study.py` (G rollouts per task, expert with
probability p, oracle A* from the envs' solvers), played with the env wrapped in
`envs.SurfaceVariation` at each level. The oracle and the behaviour policy read the engine
behind the wrapper, so a seed plays the *same* episodes (states, actions, returns, A*) at
every level; only the text the prompts and anchors are built from varies. Each batch is
thus paired across levels, and what changes between its rows is the partitions alone.

Per (env, level, seed): grouping quality against the true state (singleton rate, purity,
split rate) of the `hash` partition and of the `hidden` partition at the calibrated ε
(the trainer's `auto`: ≤ 20% singletons, cap 0.3) for each model and layer, the distance
AUC, and the Spearman correlation with A* of GRPO, GiGPO, GAGPO, the partition × baseline
pairs with w_ep = 0, and BiPACE_Q / BiGPO on each model's hidden states.

Models (`MODELS`): `pretrained`, the embedded SmolLM2-135M-Instruct; `warm_start`, the same
with the shipped TextCraft LoRA adapter (warm_starts/smollm2-135m-textcraft) merged; `tiny`,
the learning study's policy shape (a 256 x 4 Qwen2 with a byte-level BPE tokenizer trained
on the env's text, here the prompts of the first level's first seed), random init: the study's
trained checkpoints are not kept in the repository.

Writes <out>/oracle_variation_<envs>.json (after every batch) and oracle_variation_<envs>.png.
"""

from __future__ import annotations

import itertools
import math
import pickle
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench import common

__all__ = ["VariationEnv", "VARIATION_SIZES", "run_variation", "variation_tables", "variation_plot"]


@dataclass(frozen=True)
class VariationEnv:
    tasks: int
    max_turns: int
    expert_prob: float = 0.7
    group_size: int = 8
    seeds: tuple[int, ...] = (0, 1)
    models: tuple[str, ...] = ("pretrained", "warm_start", "tiny")
    big_seeds: tuple[int, ...] = (0,)  # the seeds the SmolLM2-sized models run on (tiny ones: every seed)
    env_kwargs: dict[str, Any] = field(default_factory=dict)


# (layers captured, the layer the hidden presets cluster on) per model; the tiny model's as the
# learning study's cluster_layer (-2), SmolLM2's as oracle_study.py (accuracy_layer -12).
# SmolLM2's passes stop at layer -12 (18 of 30 layers): -8 cost a quarter more and barely differed
# from -12 in the unvaried study.
MODEL_LAYERS = {
    "pretrained": ((-24, -18, -12), -12),
    "warm_start": ((-24, -18, -12), -12),
    "random_init": ((-24, -18, -12), -12),
    "tiny": ((-3, -2, -1), -2),
    "ci": ((1, -1), -1),
}

VARIATION_SIZES = {
    "full": {
        # sized for a 2-core machine shared with other jobs (a SmolLM2 pass: 5-15 s per prompt there)
        "textcraft": VariationEnv(tasks=2, max_turns=30, seeds=(0, 1, 2), models=("tiny", "pretrained", "warm_start")),
        "alfworld": VariationEnv(tasks=1, max_turns=50, seeds=(0,), models=("tiny", "pretrained"),
                                 env_kwargs={"source": "auto"}),
    },
    # the graph presets' rows (issue 51): TextCraft, 3 seeds, the tiny model's hidden states only
    "graph": {
        "textcraft": VariationEnv(tasks=2, max_turns=30, seeds=(0, 1, 2), models=("tiny",)),
    },
    "ci": {
        "textcraft": VariationEnv(tasks=2, max_turns=30, expert_prob=0.7, group_size=4, seeds=(0,), models=("ci",)),
        "alfworld": VariationEnv(tasks=1, max_turns=50, expert_prob=0.7, group_size=2, seeds=(0,), models=("ci",),
                                 env_kwargs={"source": "generated"}),
    },
}

ADAPTER = common.ROOT / "warm_starts" / "smollm2-135m-textcraft"
HIDDEN_PRESETS = ("bipace_q", "bigpo", "bipace_diff", "bigagpo", "bihgpo", "bihpace_q", "bigraphgpo")
TINY_MODELS = ("tiny", "ci")  # cheap enough for every seed


# ---------------------------------------------------------------------- models


def load_model(name: str, env: str, corpus_batch):
    """(model, tokenizer) for a name of `MODEL_LAYERS`; `corpus_batch` (a level-0 TruthBatch) trains the tiny tokenizers."""
    from bipace_trainer.models import bpe_chat_tokenizer, load_tokenizer, resolve_model_name, tiny_qwen2

    if name in ("tiny", "ci"):
        corpus = [m["content"] for t in corpus_batch.truth for m in t.messages]
        corpus += [s.reply for s in corpus_batch.rollout.steps]
        tokenizer = bpe_chat_tokenizer(corpus, 2000)
        tokenizer.add_tokens(common.fixed_prompt_text(env))
        shape = {"tiny": (256, 4), "ci": (64, 2)}[name]
        return tiny_qwen2(tokenizer, hidden_size=shape[0], layers=shape[1], seed=0), tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_name("embedded")
    tokenizer = load_tokenizer(path)
    if name == "random_init":
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32), tokenizer
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if name == "warm_start":
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(ADAPTER)).merge_and_unload()
    return model, tokenizer


# ---------------------------------------------------------------------- one batch


def _batch(env: str, ids: list[int], plan: VariationEnv, seed: int, level: float, truth, work_dir: Path):
    from studies.oracle.study import GAMMA
    from studies.oracle.truth import truth_rollouts

    name = f"batch_{env}_{'-'.join(map(str, ids))}_g{plan.group_size}_t{plan.max_turns}_s{seed}_p{plan.expert_prob}_v{level}.pkl"
    saved = work_dir / name
    if saved.exists():  # episodes are deterministic given seed and level
        return pickle.loads(saved.read_bytes())
    start = time.perf_counter()
    kwargs = {**plan.env_kwargs, "surface_variation": level, "surface_seed": seed}
    batch = truth_rollouts(env, ids, group_size=plan.group_size, expert_prob=plan.expert_prob, max_turns=plan.max_turns,
                           seed=seed, gamma=GAMMA, env_kwargs=kwargs, truth=truth)
    batch.seconds["rollout"] = time.perf_counter() - start
    saved.write_bytes(pickle.dumps(batch))
    return batch


def evaluate_base(batch) -> dict[str, Any]:
    """`oracle_study.evaluate_batch` without hidden states: hash, true, GRPO, GiGPO, GAGPO."""
    from studies.oracle.study import Size, evaluate_batch

    base = evaluate_batch(batch, {}, Size(envs={}, layers=()))
    grouping = {**base["grouping"], "hash/context": base["context"]["context"]}  # HGPO's deepest level, K = 2
    return {"estimators": base["estimators"], "axes": base["axes"], "grouping": grouping,
            "value_proxy": base["value_proxy"], "context": base["context"], "models": {}}


def evaluate_model(batch, model: str, states: dict[int, torch.Tensor]) -> dict[str, Any]:
    """`oracle_study.evaluate_batch` with one model's states, keeping its hidden rows under its name."""
    from studies.oracle.study import Size, evaluate_batch

    layers, accuracy_layer = MODEL_LAYERS[model]
    r = evaluate_batch(batch, {"pretrained": states}, Size(envs={}, layers=layers, accuracy_layer=accuracy_layer))
    grouping = {k.replace("/pretrained/", f"/{model}/"): v for k, v in r["grouping"].items() if k.startswith("hidden/")}
    calibrated = grouping[f"hidden/{model}/{accuracy_layer}"]
    grouping[f"hidden/{model}/{accuracy_layer}/context"] = {
        "calibrated_eps": calibrated["calibrated_eps"],
        "calibrated": hidden_context_quality(batch, states[accuracy_layer], calibrated["calibrated_eps"]),
    }
    return {
        "estimators": {k: v for k, v in r["estimators"].items() if k in HIDDEN_PRESETS},
        "axes": {k: v for k, v in r["axes"].items() if k.startswith("hidden/")},
        "grouping": grouping,
        "value_proxy": r["value_proxy"]["hidden"],
        "accuracy_layer": accuracy_layer,
    }


def hidden_context_quality(batch, hidden: torch.Tensor, eps: float) -> dict[str, float]:
    """Grouping quality of BiHGPO's deepest level: the K = 2 context cells over the hidden cells at `eps`."""
    from studies.oracle.metrics import grouping_quality
    from studies.oracle.study import CONTEXT_LEVELS, step_batch
    from bipace_trainer.advantages import BatchLayout, context_partition, factorize, hidden_partition

    plain = step_batch(batch, hidden=hidden)
    layout = BatchLayout.from_batch(plain)
    cells = context_partition(hidden_partition(plain.hidden, layout, eps), layout, CONTEXT_LEVELS).cell.numpy()
    steps = batch.rollout.steps
    state_ids = factorize([(s.group, t.state) for s, t in zip(steps, batch.truth)]).numpy()
    group = [s.group for s in steps]
    return grouping_quality(cells, state_ids, group)


def _grouping_summary(batch) -> dict[str, Any]:
    """How much the anchors vary: distinct anchors and distinct prompts per distinct true state."""
    states = {(s.group, t.state) for s, t in zip(batch.rollout.steps, batch.truth)}
    anchors = {(s.group, s.anchor) for s in batch.rollout.steps}
    prompts = {str(t.messages) for t in batch.truth}
    return {"true_states": len(states), "anchors": len(anchors), "distinct_prompts": len(prompts)}


def run_variation(size_name: str, levels: list[float], out: Path, work_dir: Path, only: list[str] | None) -> dict[str, Any]:
    """Every (env, level, seed) batch of `VARIATION_SIZES[size_name]`, then each model's hidden rows.

    Passes, cheapest first, the JSON rewritten after every batch of every pass: all batches with
    the hash and true-state rows; then model by model (in the plan's order), its hidden rows on each
    batch it runs on, levels in the order given. A run stopped early thus keeps every finished row.
    """
    from studies.oracle.study import TRUTH, HiddenStates, task_ids

    envs = {k: v for k, v in VARIATION_SIZES[size_name].items() if not only or k in only}
    out.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    tag = "_".join(envs)
    path = out / f"oracle_variation_{tag}.json"
    result: dict[str, Any] = {"size": size_name, "levels": levels, "plans": {k: asdict(v) for k, v in envs.items()},
                              "machine": common.machine(), "batches": [], "model_seconds": {}}
    start_all = time.perf_counter()

    def save() -> None:
        result["seconds_total"] = time.perf_counter() - start_all
        common.write_json(path, result)

    for env, plan in envs.items():
        ids = task_ids(env, plan.tasks, plan.env_kwargs)
        truth = TRUTH[env]()  # plans memoised per true state: the levels replay the same states
        batches = {}
        for level in levels:
            for seed in plan.seeds:
                batch = batches[(level, seed)] = _batch(env, ids, plan, seed, level, truth, work_dir)
                start = time.perf_counter()
                entry = {
                    "env": env, "variation": level, "seed": seed, "expert_prob": plan.expert_prob, "tasks": ids,
                    "steps": len(batch.truth),
                    "success_rate": statistics.fmean(e.won for e in batch.rollout.episodes),
                    "texts": _grouping_summary(batch),
                    **evaluate_base(batch),
                    "seconds": {"rollout": batch.seconds.get("rollout", math.nan), "hidden": {}},
                }
                entry["seconds"]["analysis"] = time.perf_counter() - start
                result["batches"].append(entry)
                save()
                print(f"{env} v {level} seed {seed}: {entry['steps']} steps, {entry['texts']}, hash singletons "
                      f"{entry['grouping']['hash']['singleton_rate']:.2f}", flush=True)
        entries = {(b["variation"], b["seed"]): b for b in result["batches"] if b["env"] == env}
        for model in plan.models:
            start = time.perf_counter()
            network, tokenizer = load_model(model, env, batches[(levels[0], plan.seeds[0])])
            capture = HiddenStates(network, tokenizer, MODEL_LAYERS[model][0],
                                   work_dir / f"hidden_variation_{env}_{model}.pt", batch_size=4)
            result["model_seconds"][f"{env}/{model}/load"] = time.perf_counter() - start
            seeds = plan.seeds if model in TINY_MODELS else [s for s in plan.seeds if s in plan.big_seeds]
            for level in levels:
                for seed in seeds:
                    batch, entry = batches[(level, seed)], entries[(level, seed)]
                    states = capture([t.messages for t in batch.truth])
                    entry["seconds"]["hidden"][model] = capture.last
                    entry["models"][model] = evaluate_model(batch, model, states)
                    save()
                    print(f"{env} v {level} seed {seed} {model}: {capture.last['prompts_computed']} prompts "
                          f"{capture.last['seconds_now']:.0f} s", flush=True)
            del network, capture
    save()
    variation_plot(result, out / f"oracle_variation_{tag}.png")
    return result


# ---------------------------------------------------------------------- report


def _stat(values) -> dict[str, float]:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return common.mean_std(values) if values else {"mean": math.nan, "std": math.nan, "n": 0}


def _fmt(stat: dict[str, float], digits: int = 2) -> str:
    if not stat["n"]:
        return "–"
    return f"{stat['mean']:.{digits}f}" if stat["n"] == 1 else f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"


def _cells(result) -> dict[tuple[str, float], list[dict[str, Any]]]:
    cells: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for b in result["batches"]:
        cells.setdefault((b["env"], b["variation"]), []).append(b)
    return cells


def _grouping_rows(batches) -> dict[str, list[dict[str, float]]]:
    """partition label -> per-batch {singleton_rate, purity, split_rate, eps, auc}."""
    rows: dict[str, list[dict[str, float]]] = {}
    for b in batches:
        for partition in ("true", "hash", "hash/context"):
            if partition in b["grouping"]:  # hash/context: runs from before HGPO have no such row
                rows.setdefault(partition, []).append(b["grouping"][partition])
        for model in b["models"].values():
            for key, g in model["grouping"].items():
                rows.setdefault(key, []).append({**g["calibrated"], "eps": g["calibrated_eps"],
                                                 "auc": g.get("separation", {}).get("auc", math.nan)})
    return rows


def variation_tables(result: dict[str, Any]) -> str:
    """The markdown tables of docs/RESULTS.md's surface-variation rows (mean ± std over seeds)."""
    lines = []
    cells = _cells(result)
    envs = list(dict.fromkeys(env for env, _ in cells))
    for env in envs:
        levels = sorted(level for e, level in cells if e == env)
        lines.append(f"\n**{env} under surface variation: how much the text varies** (per batch, mean over seeds)\n")
        lines.append("| variation | steps | true states | distinct anchors | distinct prompts | seeds |")
        lines.append("|---|---|---|---|---|---|")
        for level in levels:
            bs = cells[(env, level)]
            mean = lambda key: statistics.fmean(b["texts"][key] for b in bs)  # noqa: E731
            lines.append(f"| {level} | {statistics.fmean(b['steps'] for b in bs):.0f} | {mean('true_states'):.0f} "
                         f"| {mean('anchors'):.0f} | {mean('distinct_prompts'):.0f} | {len(bs)} |")
        lines.append(f"\n**{env} under surface variation: grouping against the true state** "
                     "(hidden: calibrated ε, ≤ 20% singletons; mean ± std over seeds)\n")
        lines.append("| partition | " + " | ".join(f"v = {level}: singletons / purity / split" for level in levels) + " |")
        lines.append("|---|" + "---|" * len(levels))
        by_level = {level: _grouping_rows(cells[(env, level)]) for level in levels}
        names = list(dict.fromkeys(k for rows in by_level.values() for k in rows))
        for name in names:
            row = []
            for level in levels:
                gs = by_level[level].get(name, [])
                row.append(" / ".join(_fmt(_stat([g[m] for g in gs])) for m in ("singleton_rate", "purity", "split_rate")))
            lines.append(f"| {name} | " + " | ".join(row) + " |")
        models = list(dict.fromkeys(m for level in levels for b in cells[(env, level)] for m in b["models"]))
        columns = [("grpo", None), ("gigpo", None), ("gagpo", None), ("graphgpo", None), ("hash/pace_q", None)]
        columns += [("true/pace_q", None)] + [("bipace_q", m) for m in models] + [("hidden/pace_q", m) for m in models]
        columns += [("bigraphgpo", m) for m in models]
        lines += _spearman_table(f"**{env} under surface variation: Spearman of the step advantage with A\\*** "
                                 "(mean ± std over seeds)", columns, levels, [cells[(env, level)] for level in levels])
        lines += _hierarchy_table(env, models, levels, [cells[(env, level)] for level in levels])
        lines.append(f"\n**{env}: cost per batch** (seconds: rollout, then hidden states per model: prompts computed)\n")
        lines.append("| variation | seed | rollout s | hidden states |")
        lines.append("|---|---|---|---|")
        for level in levels:
            for b in cells[(env, level)]:
                hid = ", ".join(
                    f"{m} {v['seconds_now']:.0f} s ({v['prompts_computed']} prompts × {v['mean_prompt_tokens']:.0f} tokens)"
                    for m, v in b["seconds"]["hidden"].items()
                )
                lines.append(f"| {level} | {b['seed']} | {b['seconds']['rollout']:.0f} | {hid} |")
    lines.append(f"\ntotal {result.get('seconds_total', 0):.0f} s")
    return "\n".join(lines)


def _spearman_table(title: str, columns, levels, batches_per_level) -> list[str]:
    """Markdown lines: one row per level, one column per (estimator or axis, model or None)."""
    lines = [f"\n{title}\n", "| variation | " + " | ".join(
        name if model is None else f"{name} ({model})" for name, model in columns) + " |", "|---|" + "---|" * len(columns)]
    for level, batches in zip(levels, batches_per_level):
        lines.append(f"| {level} | " + " | ".join(_spearman_cell(batches, name, model) for name, model in columns) + " |")
    return lines


def _hierarchy_table(env: str, models: list[str], levels, batches_per_level) -> list[str]:
    """Spearman with A* of each partition x level baseline (w_ep = 0), flat -> with HGPO's K = 2 levels."""
    lines = [f"\n**{env} under surface variation: Spearman with A\\*, flat → with HGPO's levels** (K = 2, w_ep = 0; "
             "hash + mean is `gigpo` → `hgpo`, hidden + mean `bigpo` → `bihgpo`, hidden + PACE-Q `bipace_q` → "
             "`bihpace_q`; mean ± std over seeds)\n",
             "| partition | level baseline | " + " | ".join(f"v = {level}" for level in levels) + " |",
             "|---|---|" + "---|" * len(levels)]
    rows = [(partition, None) for partition in ("hash", "true")] + [("hidden", model) for model in models]
    for (partition, model), (baseline, hierarchy) in itertools.product(rows, (("mean", "hierarchy"),
                                                                             ("pace_q", "hierarchy_pace_q"))):
        cells = [f"{_spearman_cell(batches, f'{partition}/{baseline}', model)} → "
                 f"{_spearman_cell(batches, f'{partition}/{hierarchy}', model)}" for batches in batches_per_level]
        label = partition if model is None else f"hidden ({model})"
        lines.append(f"| {label} | {baseline} | " + " | ".join(cells) + " |")
    return lines


def _spearman_cell(batches, name: str, model: str | None) -> str:
    """Mean ± std over `batches` of the Spearman with A* of an estimator or axis (of `model`'s hidden rows)."""
    values, all_zero = [], []
    for b in batches:
        source = b if model is None else b["models"].get(model, {"estimators": {}, "axes": {}})
        metric = source["estimators"].get(name) or source["axes"].get(name)
        values.append(metric["spearman"] if metric else math.nan)
        all_zero.append(bool(metric) and metric["zero_rate"] == 1.0)
    # an advantage that is 0 on every step has no rank correlation: say so instead of "–"
    return "all 0" if all_zero and all(all_zero) else _fmt(_stat(values))


def variation_plot(result: dict[str, Any], path: Path) -> None:
    """Per env: singleton rate, purity and split rate of each partition, and the Spearman of GiGPO and
    BiPACE_Q per model, against the variation level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = _cells(result)
    envs = list(dict.fromkeys(env for env, _ in cells))
    fig, axes = plt.subplots(len(envs), 4, figsize=(18, 3.8 * len(envs)), squeeze=False)
    for row, env in zip(axes, envs):
        levels = sorted(level for e, level in cells if e == env)
        by_level = {level: _grouping_rows(cells[(env, level)]) for level in levels}
        names = [n for n in dict.fromkeys(k for rows in by_level.values() for k in rows)
                 if n in ("true", "hash") or n.endswith(tuple(f"/{MODEL_LAYERS[m][1]}" for m in MODEL_LAYERS))]
        for ax, metric in zip(row[:3], ("singleton_rate", "purity", "split_rate")):
            for name in names:
                ys = [_stat([g[metric] for g in by_level[level].get(name, [])])["mean"] for level in levels]
                ax.plot(levels, ys, marker="o", lw=2.5 if name == "hash" else 1.2, label=name)
            ax.set(xlabel="surface variation", ylabel=metric.replace("_", " "), title=f"{env}: {metric.replace('_', ' ')}")
            ax.legend(fontsize=6)
        ax = row[3]
        series = {"gigpo": lambda b: b["estimators"].get("gigpo"), "grpo": lambda b: b["estimators"].get("grpo"),
                  "true/pace_q": lambda b: b["axes"].get("true/pace_q")}
        models = list(dict.fromkeys(m for level in levels for b in cells[(env, level)] for m in b["models"]))
        for model in models:
            series[f"bipace_q ({model})"] = lambda b, m=model: b["models"].get(m, {}).get("estimators", {}).get("bipace_q")
        def spearman(metric) -> float:  # an all-zero advantage carries no signal: plotted at 0, not left out
            if not metric:
                return math.nan
            return 0.0 if metric["zero_rate"] == 1.0 else metric["spearman"]

        for label, get in series.items():
            ys = [_stat([spearman(get(b)) for b in cells[(env, level)]])["mean"] for level in levels]
            ax.plot(levels, ys, marker="o", label=label)
        ax.set(xlabel="surface variation", ylabel="Spearman(advantage, A*); 0 = all-zero advantage",
               title=f"{env}: estimator vs oracle")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(paths: list[Path]) -> dict[str, Any]:
    """Merge finished runs' JSON (e.g. one per env), draw the plot next to the first, return the merged result."""
    import json

    parts = [json.loads(Path(p).read_text()) for p in paths]
    merged = {"batches": [b for p in parts for b in p["batches"]], "seconds_total": sum(p.get("seconds_total", 0) for p in parts)}
    variation_plot(merged, Path(paths[0]).parent / "oracle_variation.png")
    return merged

