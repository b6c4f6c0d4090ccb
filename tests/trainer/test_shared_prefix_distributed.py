"""`shared_prefix` under two CPU processes (DDP, DeepSpeed ZeRO-2): the same step's gradient as the plain
path on both ranks, with fewer tokens forwarded, and no hang (every rank forwards as many pieces).
Under ZeRO-3 it is off, with its reason (docs/performance.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from .test_distributed import ROOT, cpu_config

JOB = ROOT / "tests" / "trainer" / "shared_prefix_dist_job.py"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "zero2"])
def test_two_processes_give_the_plain_paths_gradient(mode, tmp_path):
    config = cpu_config(mode, tmp_path / "accelerate.yaml")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(JOB), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        on = torch.load(tmp_path / f"rank{rank}_on.pt")
        off = torch.load(tmp_path / f"rank{rank}_off.pt")
        assert on["distributed_type"].endswith("MULTI_CPU" if mode == "ddp" else "DEEPSPEED")
        assert on["enabled"] and off["stats"] is None
        assert on["stats"]["calls"] >= 1 and on["stats"]["tokens_shared"] < on["stats"]["tokens_plain"]
        assert on["loss"] == pytest.approx(off["loss"], rel=1e-5, abs=1e-7)
        assert on["delta"].keys() == off["delta"].keys() and on["delta"]
        assert any(float(d.abs().max()) > 0 for d in off["delta"].values())  # the step did move the adapter
        for name in off["delta"]:
            torch.testing.assert_close(on["delta"][name], off["delta"][name], rtol=1e-4, atol=1e-6, msg=name)
