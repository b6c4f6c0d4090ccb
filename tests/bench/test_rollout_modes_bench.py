"""bench.rollout_throughput's lockstep/continuous comparison and its simulation run (CI size) and write what they print."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run(out, *extra):
    cmd = [sys.executable, "-m", "bench.rollout_throughput", "--quick", "--out", str(out), *extra]
    proc = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(Path(out).read_text()), proc.stdout


@pytest.mark.slow
def test_the_simulation_compares_the_modes_on_the_same_episodes(tmp_path):
    result, printed = run(tmp_path / "sim.json", "--simulate", "--calibrate")
    rows = result["simulation"]
    assert {row["engine"] for row in rows} == {"gpu_hf", "gpu_vllm", "cpu_hf", "cpu_measured"}
    latency = result["measured"]["latency"]  # fitted on this machine's HF generate calls
    assert len(latency["points"]) == 6 and all(latency[k] >= 0 for k in ("per_call", "per_step", "per_token"))
    assert latency["per_step"] + latency["per_token"] > 0 and result["measured"]["env_step_s"]["tiny"] > 0
    for row in rows:
        variants = [v for v in row.values() if isinstance(v, dict) and "seconds" in v]
        assert len({v["steps"] for v in variants}) == 1  # every mode played the same episodes
        assert row["speedup_vs_lockstep_all"]["lockstep_all"] == 1.0
        assert all(0 <= v["engine_idle_share"] <= 1 and v["tokens_per_s"] > 0 for v in variants)
    assert "speed-up over lockstep" in printed


@pytest.mark.slow
def test_the_real_envs_play_both_modes_side_by_side(tmp_path):
    result, printed = run(tmp_path / "modes.json", "--modes-only")
    (row,) = result["modes"]
    assert row["env"] == "tiny" and row["episodes"] == 4
    runs = [row[name] for name in ("lockstep_all", "lockstep_half", "continuous_half")]
    assert all(0 < r["steps"] <= 4 * result["max_turns"] and r["tokens_per_s"] > 0 and r["peak_rss_bytes"] > 0 for r in runs)
    assert all(0 <= r["engine_idle_share"] <= 1 and 0 <= r["env_wait_share"] <= 1 for r in runs)
    assert row["ratio_continuous_vs_lockstep_all"] > 0
    machine = result["machine"]
    assert machine["cpu"] and "load_average" in machine and machine["omp_num_threads"] == "1"
    assert "continuous/lockstep" in printed


@pytest.mark.slow
def test_prefix_reuse_variants_play_beside_the_plain_ones(tmp_path):
    result, printed = run(tmp_path / "modes.json", "--modes-only", "--prefix-reuse")
    (row,) = result["modes"]
    for name in ("lockstep_all", "continuous_half"):
        plain, reuse = row[name], row[f"{name}_reuse"]
        assert plain["prompt_tokens_reused"] == 0 and plain["prompt_tokens_encoded"] == plain["prompt_tokens"]
        assert reuse["prompt_tokens_encoded"] + reuse["prompt_tokens_reused"] == reuse["prompt_tokens"]
        assert reuse["prefix_cache_hit_rate"] > 0 and row[f"ratio_{name}_reuse_vs_without"] > 0
    assert "with prefix reuse / without" in printed
