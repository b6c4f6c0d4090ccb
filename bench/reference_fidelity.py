"""How far each compatibility preset is from its reference: the algorithm (float64) and the published float32 code.

    OMP_NUM_THREADS=1 python -m bench.reference_fidelity                  # 400 batches per estimator
    OMP_NUM_THREADS=1 python -m bench.reference_fidelity --examples 100 --out /tmp/fidelity.json

For `gigpo`, `hgpo`, `graphgpo` and `beacon` in their compatibility settings (`episode_stats="steps"`), on
batches drawn by the compatibility tests' own strategies (tests/advantages: `step_lists`,
`graph_batches`, `beacon_batches`; hypothesis, derandomized, so a rerun draws the same batches), the
largest |A_ours − A_ref| per row against the transcriptions of the authors' code (verl-agent's, and
BEACON's `core_migpo.py`: tests/advantages/*_reference.py). `beacon` runs its two run scripts'
settings, keyed by γ: ALFWorld's γ 0.9 with segment weight 10, WebShop's and ScienceWorld's γ 0.95
with weight 1 (its differences scale with the weight), on static plans and dynamic flags alike:

- "algorithm": the reference in float64 with a group's mean taken exactly where the transcription
  offers it (`exact_mean`): a difference here is a difference in method;
- "float32 code": the reference as published (float32, `torch.mean`), split into the rows one of
  whose means runs over equal values (its task group's episode scores, or the returns of one of its
  state cells, HGPO's context levels included: the code's float32 mean of n equal values can be one
  rounding step off, and ÷ (std + 1e-6), std that same residue, it becomes an advantage of up to
  ~0.6 where the method gives 0) and the other rows (float32 rounding of unequal values, e.g. a
  cell {x, x, x − 0.1}; the worst row's cell is recorded), per γ;
- and, apart, the float32 code's worst advantage on cells of G equal returns (G identical
  successful trajectories, G = 2..16, 1..6 steps each), where the method's is exactly 0.

Prints a markdown table and writes JSON (with the machine) to `--out`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import common
from bipace_trainer.advantages import StepBatch, estimate_advantages, resolve_settings

OUT = Path("docs/results/reference_fidelity.json")
GAMMAS = {"gigpo": (0.9, 0.95, 1.0), "hgpo": (0.9, 0.95, 1.0), "graphgpo": (0.1, 0.5, 0.95), "beacon": (0.9, 0.95)}
BEACON_WEIGHTS = {0.9: 10.0, 0.95: 1.0}  # BEACON's run scripts: ALFWorld γ 0.9 weight 10; WebShop, ScienceWorld γ 0.95 weight 1
MODES = {"mean_std": "mean_std_norm", "mean": "mean_norm"}
LEVELS = {"gigpo": 0, "hgpo": 2, "graphgpo": 0}  # context levels of the state cells each preset's means run over


def _rows(steps):
    steps = sorted(steps, key=lambda s: (s["traj"], s["t"]))
    return [(s["group"], s["traj"], s["t"], s["reward"], s["valid"], s["anchor"]) for s in steps]


def _all_equal(values) -> bool:
    """Equal in exact arithmetic: 0.95² − 0.1 and 0.8025 differ in float64 by a rounding step only."""
    return len(values) > 1 and max(values) - min(values) <= 1e-9 * max(1.0, max(map(abs, values)))


def equal_value_rows(rows, returns, levels: int, penalty: float = 0.1) -> torch.Tensor:
    """(N,) bool: a mean the row's advantage takes is one of equal values, in exact arithmetic: its
    task group's episode scores (R^ep minus each row's penalty, over rows, as `episode_stats="steps"`),
    or the returns of one of its state cells (the anchor; under HGPO each context level k ≤ `levels`)."""
    group, traj, t, reward, valid, anchor = ([r[i] for r in rows] for i in range(6))
    episode = defaultdict(float)
    for j, r in zip(traj, reward):
        episode[j] += r
    scores, cells = defaultdict(list), defaultdict(list)
    history: dict = defaultdict(list)
    keys = []
    for i in range(len(rows)):  # rows in trajectory order
        scores[group[i]].append(episode[traj[i]] - penalty * (not valid[i]))
        history[traj[i]].append(anchor[i])
        row_keys = [(group[i], tuple(history[traj[i]][-(k + 1):])) for k in range(min(levels, t[i]) + 1)]
        for key in row_keys:
            cells[key].append(float(returns[i]))
        keys.append(row_keys)
    return torch.tensor([_all_equal(scores[group[i]]) or any(_all_equal(cells[k]) for k in keys[i]) for i in range(len(rows))])


def gigpo_case(rows, gamma, norm):
    from tests.advantages.gigpo_reference import gigpo_advantages

    group, traj, t, reward, valid, anchor = (list(col) for col in zip(*rows))
    batch = StepBatch(group=group, traj=traj, t=t, reward=reward, valid=valid, anchor=anchor)
    settings_ = resolve_settings("gigpo", episode_stats="steps", advantage_norm=norm, step_gamma=gamma)
    estimate = estimate_advantages(batch, settings_)
    reference = {dtype: gigpo_advantages(group, traj, reward, valid, anchor, gamma=gamma, mode=MODES[norm], dtype=dtype)
                 for dtype in (torch.float64, torch.float32)}  # fmt: skip
    return estimate, reference[torch.float64], reference[torch.float32], group, anchor


def hgpo_case(rows, gamma, norm):
    from tests.advantages.hgpo_reference import hgpo_advantages

    group, traj, t, reward, valid, anchor = (list(col) for col in zip(*rows))
    batch = StepBatch(group=group, traj=traj, t=t, reward=reward, valid=valid, anchor=anchor)
    settings_ = resolve_settings("hgpo", episode_stats="steps", advantage_norm=norm, step_gamma=gamma)
    estimate = estimate_advantages(batch, settings_)
    common_args = dict(history_length=2, gamma=gamma, mode=MODES[norm])
    algorithm = hgpo_advantages(group, traj, reward, valid, anchor, dtype=torch.float64, exact_mean=True, **common_args)
    code = hgpo_advantages(group, traj, reward, valid, anchor, dtype=torch.float32, exact_mean=False, **common_args)
    return estimate, algorithm, code, group, anchor


def graphgpo_case(rows, gamma, norm):
    from tests.advantages.graphgpo_reference import graphgpo_advantages

    group, traj, t, reward, valid, anchor, nxt = (list(col) for col in zip(*rows))
    batch = StepBatch(group=group, traj=traj, t=t, reward=reward, valid=valid, anchor=anchor, next_anchor=nxt)
    settings_ = resolve_settings("graphgpo", episode_stats="steps", advantage_norm=norm, step_gamma=gamma)
    estimate = estimate_advantages(batch, settings_)
    common_args = dict(gamma=gamma, mode=MODES[norm])
    algorithm = graphgpo_advantages(group, traj, reward, valid, anchor, nxt, dtype=torch.float64, exact_mean=True, **common_args)
    code = graphgpo_advantages(group, traj, reward, valid, anchor, nxt, dtype=torch.float32, exact_mean=False, **common_args)
    return estimate, algorithm, code, group, anchor


def beacon_case(batch, gamma, norm):
    """`batch`: (rows, plans) of the compatibility test's strategy, rows (group, traj, t, reward, valid,
    action, trial, flag); `plans` None: the dynamic path (the flags). The last item is each row's
    segment cell, the cell its step term's mean runs over."""
    from tests.advantages.beacon_reference import beacon_advantages

    rows, plans = batch
    group, traj, t, reward, valid, action, trial, flag = (list(col) for col in zip(*rows))
    static = plans is not None
    step_batch = StepBatch(group=group, traj=traj, t=t, reward=reward, valid=valid, action_text=action,
                           milestone=None if static else flag,
                           milestone_plan=[plans.get(k) for k in trial] if static else None)  # fmt: skip
    weight = BEACON_WEIGHTS[gamma]
    settings_ = resolve_settings("beacon", episode_stats="steps", advantage_norm=norm, step_gamma=gamma, w_step=weight)
    estimate = estimate_advantages(step_batch, settings_)
    common_args = dict(trial_id=trial if static else None, loader=plans, milestone_achieved=None if static else flag,
                       gamma=gamma, mode=MODES[norm], step_advantage_w=weight)  # fmt: skip
    algorithm = beacon_advantages(group, traj, reward, valid, action, dtype=torch.float64, exact_mean=True, **common_args)
    code = beacon_advantages(group, traj, reward, valid, action, dtype=torch.float32, exact_mean=False, **common_args)
    return estimate, algorithm, code, group, estimate.cell.tolist()


def beacon_equal_rows(rows, estimate, penalty: float = 0.1) -> torch.Tensor:
    """(N,) bool: the row's task group's episode scores are equal, or its segment cell's step rewards
    (`step_return`, the penalty included) are, in exact arithmetic."""
    episode, scores, cells = defaultdict(float), defaultdict(list), defaultdict(list)
    for row in rows:
        episode[row[1]] += row[3]
    for i, row in enumerate(rows):
        scores[row[0]].append(episode[row[1]] - penalty * (not row[4]))
        cells[int(estimate.cell[i])].append(float(estimate.step_return[i]))
    return torch.tensor([_all_equal(scores[row[0]]) or _all_equal(cells[int(estimate.cell[i])])
                         for i, row in enumerate(rows)])  # fmt: skip


def measure(name: str, examples: int) -> dict:
    """Largest differences per γ over `examples` derandomized batches of the compatibility tests' strategy."""
    from tests.advantages.strategies import step_lists
    from tests.advantages.test_beacon_compat import beacon_batches
    from tests.advantages.test_graphgpo_compat import graph_batches

    case = CASES[name]
    batches = {"graphgpo": graph_batches(), "beacon": st.booleans().flatmap(beacon_batches)}.get(
        name, step_lists(max_groups=4, max_traj=6, max_len=8).map(_rows))
    found: dict = defaultdict(lambda: {"algorithm": 0.0, "code_unequal": 0.0, "code_equal": 0.0, "rows": 0,
                                       "equal_rows": 0, "batches": 0})  # fmt: skip

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(rows=batches, gamma=st.sampled_from(GAMMAS[name]), norm=st.sampled_from(["mean_std", "mean"]))
    def one(rows, gamma, norm):
        estimate, algorithm, code, group, anchor = case(rows, gamma, norm)
        if name == "beacon":
            rows = rows[0]
            equal = beacon_equal_rows(rows, estimate)
        else:
            equal = equal_value_rows([r[:6] for r in rows], estimate.step_return, LEVELS[name])
        ours = estimate.advantage.to(torch.float64)
        code_gap = (ours - code.to(torch.float64)).abs()
        f = found[gamma]
        f["algorithm"] = max(f["algorithm"], float((ours - algorithm.to(torch.float64)).abs().max()))
        unequal = torch.where(equal, 0.0, code_gap)
        if float(unequal.max()) > f["code_unequal"]:  # the worst row so far, and its cell's returns: the cause
            row = int(unequal.argmax())
            cell = [j for j, key in enumerate(zip(group, anchor)) if key == (group[row], anchor[row])]
            f["code_unequal_at"] = {"norm": norm, "cell_returns": [float(estimate.step_return[j]) for j in cell],
                                    "group_rows": sum(g == group[row] for g in group), "t": rows[row][2],
                                    "ours": float(ours[row]), "code": float(code[row])}  # fmt: skip
        f["code_unequal"] = max(f["code_unequal"], float(unequal.max()))
        f["code_equal"] = max(f["code_equal"], float(code_gap[equal].max()) if bool(equal.any()) else 0.0)
        f["rows"] += len(group)
        f["equal_rows"] += int(equal.sum())
        f["batches"] += 1

    one()
    return {str(gamma): values for gamma, values in sorted(found.items())}


def equal_return_noise(name: str, gamma: float, sizes=range(2, 17), lengths=range(1, 7)) -> dict:
    """The float32 code's advantage where every return of a cell is equal: G identical successful
    trajectories through `length` states (G in `sizes`), the method's answer being 0 on every row."""
    worst = {"noise": 0.0, "group_size": None, "length": None}
    for length in lengths:
        states = "abcdefgh"[:length]
        for size in sizes:
            rows = []
            for j in range(size):
                for t, state in enumerate(states):
                    last = t == length - 1
                    row = (0, j, t, 10.0 if last else 0.0, True, state)
                    extra = {"graphgpo": ("success" if last else states[t + 1],), "beacon": ("trial", False)}
                    rows.append(row + extra.get(name, ()))
            batch = (rows, {"trial": [states[-1]]}) if name == "beacon" else rows  # one milestone: the last step
            estimate, _, code, _, _ = CASES[name](batch, gamma, "mean_std")
            noise = float((code.to(torch.float64) - estimate.advantage.to(torch.float64)).abs().max())
            if noise > worst["noise"]:
                worst = {"noise": noise, "group_size": size, "length": length}
    return worst


CASES = {"gigpo": gigpo_case, "hgpo": hgpo_case, "graphgpo": graphgpo_case, "beacon": beacon_case}


def _size(value: float) -> str:
    """0 where exactly 0; three decimals where the artifact is visible, else its order of magnitude."""
    return "0" if value == 0 else f"{value:.3f}" if value >= 1e-3 else f"{value:.1e}"


def table(result: dict) -> str:
    lines = ["| preset | γ | batches (rows) | vs its algorithm (float64) | vs its float32 code: other rows | "
             "rows with a mean of equal values (rows) | G equal successes, worst |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, by_gamma in result["presets"].items():
        for gamma, f in by_gamma.items():
            noise = result["equal_return_noise"][name][gamma]
            lines.append(f"| `{name}` | {gamma} | {f['batches']} ({f['rows']}) | {f['algorithm']:.1e} | "
                         f"{f['code_unequal']:.1e} | {_size(f['code_equal'])} ({f['equal_rows']}) | {_size(noise['noise'])}"
                         + (f" (G = {noise['group_size']}, {noise['length']} steps) |" if noise["group_size"] else " |"))  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=400, help="batches per preset (spread over γ and both modes)")
    parser.add_argument("--presets", nargs="+", default=list(GAMMAS), choices=list(GAMMAS))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    presets = {name: measure(name, args.examples) for name in args.presets}
    noise = {name: {str(gamma): equal_return_noise(name, gamma) for gamma in GAMMAS[name]} for name in args.presets}
    result = {"examples": args.examples, "presets": presets, "equal_return_noise": noise,
              "seconds": time.perf_counter() - start, "machine": common.machine()}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
