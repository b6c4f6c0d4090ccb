"""The learning study and the cost and rollout-throughput benches run at CI size
(`python -m studies.learning.study --quick`, `python -m bench.<name> --quick`)
and write the JSON they promise."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from studies.learning import study as learning_study
from studies.learning.plan import SIZES, rl_config

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1")
PRESETS = {"grpo", "gigpo", "bipace_q", "gagpo", "bigagpo"}


def run(module: str, *args) -> str:
    """`python -m <module> --quick ...` from the repository root, as the docs run it."""
    cmd = [sys.executable, "-m", module if "." in module else f"bench.{module}", "--quick", *map(str, args)]
    proc = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def is_rate(value) -> bool:
    return 0.0 <= value <= 1.0


@pytest.mark.slow
def test_learning_study(tmp_path):
    printed = run("studies.learning.study", "--out", tmp_path, "--work-dir", tmp_path / "work")
    result = json.loads((tmp_path / "learning_study.json").read_text())
    assert (tmp_path / "learning_tiny.png").stat().st_size > 0
    env = result["envs"]["tiny"]
    assert all(is_rate(e["success_rate"]) for e in env["warm_start"]["evals"])
    assert set(env["presets"]) == PRESETS and "bipace_q" in printed and result["seeds"] == [0]
    assert "valid, final success per task type" in printed
    for row in env["presets"].values():
        final, peak = row["final"]["valid"], row["peak"]
        assert final["n"] == 1 and is_rate(final["mean"]) and peak["mean"] >= final["mean"]
        assert set(row["per_type_final"]) <= {"distance=1", "distance=2", "distance=3"} and row["per_type_final"]
        assert row["per_type_final_by_split"] == {"valid": row["per_type_final"]}
        assert set(row["steps_to_gain"]) == {"+0.05", "+0.1", "+0.2"}
        for key in ("train_success", "hash_singleton_rate", "hidden_singleton_rate", "nonzero_advantage"):
            assert is_rate(row[key]), key
        branches = sum(row[f"hidden_branch_{b}"] for b in ("pace", "loo", "singleton"))
        assert math.isclose(branches, 1.0, abs_tol=1e-6)
        assert row["hidden_eps"] >= 0 and row["advantage_std"] >= 0 and row["seconds_per_step"] > 0
        assert -1.0 <= row["train_success_minus_grpo_2nd_half"]["mean"] <= 1.0
    assert env["presets"]["grpo"]["train_success_minus_grpo_2nd_half"] == {"mean": 0.0, "std": 0.0, "n": 1}
    (host,) = result["hosts"]  # the warm start and the 5 runs, all on this machine
    assert host["jobs"] == 6 and host["platform"] == result["machine"]["platform"] and host["cpu"]
    success = {run_["preset"]: [r["train_success"] for r in run_["curve"]] for run_ in env["runs"]}  # one seed
    grpo, gigpo = success["grpo"], success["gigpo"]
    expected = ((gigpo[1] - grpo[1]) + (gigpo[2] - grpo[2])) / 2  # steps 2 and 3 of 3
    assert math.isclose(env["presets"]["gigpo"]["train_success_minus_grpo_2nd_half"]["mean"], expected, abs_tol=1e-12)
    for run_ in env["runs"]:
        assert [r["step"] for r in run_["curve"]] == [1, 2, 3]
        assert [(e["split"], e["step"]) for e in run_["evals"]] == [("valid", 2), ("valid", 3)]

    # --warm-only stops after the (here reused) warm start and writes it on its own
    run("studies.learning.study", "--out", tmp_path / "warm", "--work-dir", tmp_path / "work", "--resume", "--warm-only")
    warm = json.loads((tmp_path / "warm" / "learning_quick_tiny_warm.json").read_text())
    assert warm["evals"] == env["warm_start"]["evals"]
    assert not (tmp_path / "warm" / "learning_study.json").exists()

    # --first-seed extends the study from the same warm start: seed 1 only, seed 0's runs untouched
    run("studies.learning.study", "--out", tmp_path / "more", "--work-dir", tmp_path / "work", "--resume", "--first-seed", "1",
        "--presets", "grpo")
    more = json.loads((tmp_path / "more" / "learning_study.json").read_text())
    assert more["seeds"] == [1] and [(r["preset"], r["seed"]) for r in more["envs"]["tiny"]["runs"]] == [("grpo", 1)]
    assert more["envs"]["tiny"]["warm_start"]["evals"] == env["warm_start"]["evals"]
    assert sorted(p.name for p in (tmp_path / "work" / "tiny" / "runs").glob("*.json")) == sorted(
        [f"{preset}-seed0.json" for preset in PRESETS] + ["grpo-seed1.json"])


@pytest.mark.slow
def test_cost(tmp_path):
    run("cost", "--out", tmp_path / "cost.json")
    result = json.loads((tmp_path / "cost.json").read_text())
    assert (tmp_path / "cost.png").stat().st_size > 0
    assert result["same_batches"], "lr 0 and one seed must give every variant the same rollouts"
    variants = result["variants"]
    assert set(variants) == {"grpo", "gigpo", "bipace_q", "bipace_q/forward", "gagpo", "bigagpo"}
    for name, variant in variants.items():
        median = variant["median"]
        assert median["step_s"] > 0 and median["generate_s"] > 0 and median["update_s"] > 0, name
    assert variants["bipace_q/forward"]["median"]["hidden_s"] > 0
    for name, variant in variants.items():  # phases partition the rollout: the extra pass is not also in generate
        median = variant["median"]
        assert median["generate_s"] + median["env_s"] + median["hidden_s"] <= median["rollout_s"] * 1.001, name
    assert variants["bipace_q"]["median"]["hidden_s"] == 0  # the hook costs no separate pass
    share = result["bipace_share"]
    assert share["paper"] == 0.113 and 0 < share["bipace_q/forward"]["hidden_forward_pass"] < 1


@pytest.mark.slow
def test_rollout_throughput(tmp_path):
    run("rollout_throughput", "--out", tmp_path / "throughput.json")
    result = json.loads((tmp_path / "throughput.json").read_text())
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert [row["num_envs"] for row in result["rows"]] == [1, 2, 4, 8]
    for row in result["rows"]:
        assert row["lockstep"]["tokens"] > 0 and row["trl_single_turn"]["tokens"] > 0
        assert row["ratio_lockstep_vs_trl"] > 0 and row["ratio_lockstep_vs_one_at_a_time"] > 0
    assert result["one_at_a_time"]["episodes"] == 2 and result["one_at_a_time"]["tokens_per_s"] > 0


@pytest.mark.slow
def test_overlap_step_time(tmp_path):
    printed = run("overlap_step_time", "--out", tmp_path / "overlap.json")
    result = json.loads((tmp_path / "overlap.json").read_text())
    rows = {(row["variant"], row["max_staleness"]): row for row in result["rows"]}
    assert set(rows) == {("lora", 0), ("lora", 1)}
    assert rows[("lora", 1)]["staleness_logged"][0] == 0.0 and rows[("lora", 1)]["staleness_logged"][1:] == [1.0, 1.0]
    assert all(row["step_s_median"] > 0 and row["speedup_vs_off"] > 0 for row in rows.values())
    assert "speed-up" in printed


def test_learning_study_set_overrides_name_the_field():
    args = learning_study.parse_args(["--set", "cluster_eps=0.05", "--set", "cluster_layer=-1", "--set", "preset=gigpo"])
    assert args.overrides == {"cluster_eps": 0.05, "cluster_layer": -1, "preset": "gigpo"}
    for bad in ("cluster_eps", "no_such_field=1"):
        with pytest.raises(SystemExit):
            learning_study.parse_args(["--set", bad])


def test_every_study_size_builds_valid_rl_configs(tmp_path):
    """Each size's plans give a BiPACEConfig that passes validation (a typo in a size
    would otherwise surface only after its warm start, minutes or hours in)."""
    import torch

    for name, size in SIZES.items():
        assert size.envs, name
        # a GPU size trains in bf16, which a machine without CUDA refuses (as GRPOConfig does): validate the rest
        cpu_here = {"bf16": False} if size.device != "cpu" and not torch.cuda.is_available() else None
        for plan in size.envs.values():
            config = rl_config(plan, size, tmp_path, tmp_path / "run", preset="bipace_q", overrides=cpu_here)
            assert config.max_steps == plan.rl_steps and config.eval_split == plan.eval_splits[0], name
            assert config.num_generations == plan.num_generations, name


def test_learning_study_first_seed_must_not_be_negative(capsys):
    assert learning_study.parse_args(["--first-seed", "3"]).first_seed == 3
    with pytest.raises(SystemExit):
        learning_study.parse_args(["--first-seed", "-1"])
    assert "--first-seed -1" in capsys.readouterr().err


def test_learning_study_step_overrides_reach_every_env():
    args = learning_study.parse_args(["--size", "cpu-envs", "--rl-steps", "3", "--sft-steps", "7", "--envs", "textcraft"])
    size = learning_study.resolve_size(args)
    assert list(size.envs) == ["textcraft"]
    assert all(plan.rl_steps == 3 and plan.sft_steps == 7 for plan in size.envs.values())
    untouched = learning_study.resolve_size(learning_study.parse_args(["--size", "cpu-envs"]))
    assert untouched.envs == SIZES["cpu-envs"].envs
