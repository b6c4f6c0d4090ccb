"""The estimator and env benchmarks run (CI size) and write the numbers they print."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run(module, out, *extra):
    cmd = [sys.executable, "-m", f"bench.{module}", "--quick", "--out", str(out), *extra]
    proc = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_estimator_benchmark(tmp_path):
    result, printed = run("estimators", tmp_path / "estimators.json")
    presets = {row["preset"] for row in result["presets"]}
    assert presets == {
        "grpo", "gigpo", "bigpo", "bipace_q", "bipace_diff", "gagpo", "bigagpo", "hgpo", "bihgpo", "bihpace_q",
        "graphgpo", "bigraphgpo", "beacon", "beacon (plan)",
    }  # fmt: skip
    assert all(row["steps_per_s"] > 0 and row["reference_seconds"] > 0 for row in result["presets"])
    # the hierarchy presets are timed against verl-agent's HGPO, the others against its GiGPO
    assert {row["preset"] for row in result["presets"] if row["reference"] == "hgpo"} == {"hgpo", "bihgpo", "bihpace_q"}
    assert {row["preset"] for row in result["presets"] if row["reference"] == "graphgpo"} == {"graphgpo", "bigraphgpo"}
    assert {row["preset"] for row in result["presets"] if row["reference"] == "beacon"} == {"beacon", "beacon (plan)"}
    assert {row["preset"] for row in result["scaling"]} == {"gigpo", "bipace_q", "gagpo", "hgpo", "graphgpo", "beacon"}
    assert 0.0 <= result["calibration"]["eps"] <= 0.3
    assert "speed-up" in printed


@pytest.mark.slow
def test_clustering_benchmark_times_both_growth_rules_on_the_same_labels(tmp_path):
    result, printed = run("estimators", tmp_path / "clustering.json", "--clustering")
    rows = result["clustering"]
    assert [r["states_per_group"] for r in rows] == [30, 170] and all(r["same_labels"] for r in rows)
    assert all(r["steps_per_s"] > 0 and r["steps_per_s_doubling"] > 0 for r in rows)
    assert result["auto_eps"]["second_seconds"] < result["auto_eps"]["first_seconds"]
    assert "doubling" in printed


@pytest.mark.slow
def test_env_benchmark(tmp_path):
    result, printed = run("envs", tmp_path / "envs.json")
    assert result and "tiny" in json.dumps(result)
