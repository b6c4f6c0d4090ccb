"""bench/gpu_check.sh on a machine without a GPU (exits 0 and says it needs one; its Python
compiles and runs its code path on a CPU with --cpu_smoke), and bench/memory.py's phase
attribution."""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check
from bench.memory import attribute, timeline

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, PYTHONPATH=str(ROOT))

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the check runs for real where there is a GPU")


@no_gpu
def test_the_gpu_check_exits_0_saying_it_needs_a_gpu(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=dict(ENV, OUT=str(out)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == gpu_check.NEEDS_GPU
    assert not list(out.iterdir())  # nothing measured, nothing written


@no_gpu
def test_the_gpu_checks_python_compiles_and_refuses_without_a_gpu(tmp_path, capsys):
    py_compile.compile(str(ROOT / "bench" / "gpu_check.py"), cfile=str(tmp_path / "gpu_check.pyc"), doraise=True)
    assert gpu_check.main(["--out", str(tmp_path / "x.json")]) == 0
    assert capsys.readouterr().out.strip() == gpu_check.NEEDS_GPU
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(SystemExit):
        gpu_check.main(["--sizes", "7b"])


def test_the_qwen25_sizes_are_the_published_ones():
    from transformers import Qwen2Config

    # parameter counts of Qwen2.5-0.5B and -1.5B (tied embeddings): 494M and 1.54B
    for size, published in (("0.5b", 494_032_768), ("1.5b", 1_543_714_304)):
        config = Qwen2Config(vocab_size=gpu_check.QWEN25_VOCAB, **gpu_check.QWEN25_SIZES[size])
        with torch.device("meta"):
            model = __import__("transformers").Qwen2ForCausalLM(config)
        assert sum(p.numel() for p in model.parameters()) == published


@pytest.mark.slow
def test_the_gpu_check_runs_its_path_on_a_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--cpu_smoke", "--sizes", "0.5b", "--steps", "2",
                           "--out", str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["runs"] and all("error" not in run for run in result["runs"])
    modes = {run["rollout_mode"] for run in result["runs"]}
    assert modes == set(result["modes"]) and "lockstep" in modes
    for run in result["runs"]:
        assert run["steps"] == 2 and all(t > 0 for t in run["generated_tokens"])
        assert run["rollout_tokens_per_s_after_first"] > 0


def test_memory_samples_count_for_the_innermost_open_phase():
    marks = [
        {"t": 1.0, "phase": "step", "event": "enter"},
        {"t": 2.0, "phase": "rollout", "event": "enter"},
        {"t": 4.0, "phase": "rollout", "event": "exit"},
        {"t": 6.0, "phase": "step", "event": "exit"},
    ]
    mb = 2**20
    samples = [(0.5, 100 * mb), (1.5, 300 * mb), (3.0, 200 * mb), (5.0, 900 * mb), (7.0, 50 * mb)]
    phases = attribute(samples, marks)
    assert phases["rollout"] == {"peak_mb": 200.0, "seconds": 2.0, "entries": 1}
    assert phases["step"] == {"peak_mb": 900.0, "seconds": 5.0, "entries": 1}  # 300 before, 900 after the rollout
    assert phases["other"]["peak_mb"] == 100.0  # 0.5 s and 7 s: no phase open
    curve = timeline(samples, marks, start=0.0, points=2)
    assert max(curve["rss_mb"]) == 900 and len(curve["rss_mb"]) <= 3
    assert curve["marks"][0] == [1.0, "step", "enter"]
