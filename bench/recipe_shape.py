"""A paper recipe at its real model shape on a CPU: one step of the ALFWorld recipe through `accelerate
launch` with accelerate_config_cpu.yaml (2 processes, DeepSpeed ZeRO-2, or ZeRO-3), on a randomly
initialised model of Qwen2.5-0.5B's exact shape. Records the time and each rank's peak memory
(docs/tutorials/scaling.md, "A recipe at its real shape on a CPU").

    python -m bench.recipe_shape                       # ZeRO-2, bf16 as the recipe writes it
    python -m bench.recipe_shape --zero_stage 3
    python -m bench.recipe_shape --quick               # a 12-layer, 64-wide model of the same vocabulary (CI size; the recipe clusters at layer -12)

The model is built here from transformers' Qwen2Config (vocab 151936, hidden 896, 24 layers, 14
heads, 2 KV heads, intermediate 4864, tied embeddings; no download) and saved with the embedded
SmolLM2 tokenizer (vocab 49152, a real English BPE with a chat template): every id it makes is in
the model's range; ids the random model generates above 49151 decode to nothing (the tokenizer
skips ids it does not know) and are trained on as generated. Every recipe setting is kept as
written except the sizes in `CUTS` (and output_dir, model_name_or_path), which are printed.
bf16 on the CPU: the recipe's `bf16: true` with `--use_cpu true`, and `--mixed_precision bf16`
for DeepSpeed (the CPU config's float32 otherwise); `--precision fp32` runs float32 instead.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "alfworld_qwen2.5-1.5b_bipace_q.yaml"
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False)
QUICK_SHAPE = dict(QWEN25_05B, hidden_size=64, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128)
# the recipe's sizes, cut to one step on 2 CPU processes: one task group per rank, the smallest group,
# two turns of 32 tokens, one row per forward; everything else as the recipe writes it
CUTS = dict(max_steps=1, tasks_per_iteration=2, num_generations=2, max_turns=2, max_completion_length=32,
            per_device_train_batch_size=1, eval_tasks=2, env_workers=2)


def build_model(folder: Path, shape: dict) -> None:
    """A random Qwen2 of `shape` in bf16, with the embedded SmolLM2 tokenizer, saved to `folder`."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from bipace_trainer.models import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_path()))
    config = Qwen2Config(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, shape {shape}", flush=True)


def write_recipe(recipe: Path, model: Path, out: Path) -> Path:
    values = yaml.safe_load(recipe.read_text())
    cut = {key: (values.get(key), value) for key, value in CUTS.items()}
    values.update(CUTS, model_name_or_path=str(model), output_dir=str(out / "run"))
    path = out / "recipe.yaml"
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    print("cut (recipe -> here): " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in cut.items()), flush=True)
    return path


class PeakMemory(threading.Thread):
    """Each train.py rank's peak RSS (VmHWM) and its env workers' summed RSS, polled every 0.5 s."""

    def __init__(self, launcher_pid: int):
        super().__init__(daemon=True)
        self.launcher, self.ranks, self.workers, self.done = launcher_pid, {}, 0, threading.Event()

    def run(self):
        import psutil

        while not self.done.wait(0.5):
            try:
                tree = psutil.Process(self.launcher).children(recursive=True)
            except psutil.Error:
                return
            workers = 0
            for proc in tree:
                try:
                    rank = proc.environ().get("RANK")
                    if rank is not None and "train.py" in " ".join(proc.cmdline()):
                        status = Path(f"/proc/{proc.pid}/status").read_text()
                        hwm = int(next(l for l in status.splitlines() if l.startswith("VmHWM")).split()[1]) * 1024
                        self.ranks[rank] = max(self.ranks.get(rank, 0), hwm)
                    elif rank is not None:
                        workers += proc.memory_info().rss
                except (psutil.Error, OSError, StopIteration):
                    continue
            self.workers = max(self.workers, workers)


def launch(recipe: Path, out: Path, zero_stage: int, precision: str) -> dict:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_config_cpu.yaml"),
           "--main_process_port", str(port), "--zero_stage", str(zero_stage),
           "--mixed_precision", "bf16" if precision == "bf16" else "no",
           str(ROOT / "train.py"), "--config", str(recipe), "--summary_file", str(out / "summary.json")]
    cmd += ["--use_cpu", "true"] if precision == "bf16" else ["--bf16", "false", "--dtype", "float32"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    with open(out / "launch.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        memory = PeakMemory(proc.pid)
        memory.start()
        code = proc.wait()
        memory.done.set()
    seconds = time.perf_counter() - start
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return {"returncode": code, "seconds": seconds, "steps": summary.get("steps"), "zero_stage": zero_stage,
            "precision": precision, "peak_rss_gib_per_rank": {r: round(b / 2**30, 2) for r, b in sorted(memory.ranks.items())},
            "env_workers_peak_rss_gib": round(memory.workers / 2**30, 2), "log": str(out / "launch.log")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(RECIPE))
    parser.add_argument("--zero_stage", type=int, default=2, choices=(2, 3))
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--quick", action="store_true", help="a 12-layer, 64-wide model of the same vocabulary")
    parser.add_argument("--workdir", default=None, help="keep the model and the run here (default: a temp folder)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="recipe_shape_") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        # in a child process: this one would keep the built model's ~1 GiB (bf16 0.5B) for the whole run
        shape = json.dumps(QUICK_SHAPE if args.quick else QWEN25_05B)
        subprocess.run([sys.executable, "-c", "import json, sys; from bench.recipe_shape import build_model; "
                        "from pathlib import Path; build_model(Path(sys.argv[1]), json.loads(sys.argv[2]))",
                        str(work / "model"), shape], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)
        build_seconds = time.perf_counter() - start
        result = launch(write_recipe(Path(args.recipe), work / "model", work), work, args.zero_stage, args.precision)
        result.update(recipe=str(Path(args.recipe).relative_to(ROOT)) if Path(args.recipe).is_relative_to(ROOT)
                      else args.recipe, shape="quick" if args.quick else "Qwen2.5-0.5B", cuts=CUTS,
                      build_seconds=round(build_seconds, 1))
        if result["returncode"] != 0:
            print((work / "launch.log").read_text()[-6000:])
        print(json.dumps(result, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
    if result["returncode"] != 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
