"""A shipped recipe, shrunk to the tiny setup, run by train.py: it writes checkpoint-N at its
own save_steps, logs to its tracker (TensorBoard), and ends the run cleanly, also as two
processes under `accelerate launch`."""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bipace_trainer.cli import train  # noqa: E402
from envs.tiny import TinyEnv  # noqa: E402
from tests.trainer.test_distributed import free_port  # noqa: E402

RECIPE = ROOT / "recipes" / "textcraft_qwen2.5-1.5b_gigpo.yaml"
# What shrinking changes: the model, env and sizes, and what a CPU cannot do (bf16, process
# pools). Everything else (saving, tracker, PEFT off, lr schedule, KL, clip, γ, ...) is the recipe's.
SHRINK = dict(
    env_name="tiny", env_kwargs='{"size": 4}', max_turns=3, history_length=1, tasks_per_iteration=1, num_generations=2,
    per_device_train_batch_size=2, gradient_accumulation_steps=1, max_completion_length=16, eval_split="valid",
    eval_interval=0, dtype="float32", bf16=False, use_cpu=True, env_backend="serial", env_workers=None,
    cluster_layer=-1, learning_rate=1e-4,
)  # fmt: skip


def shrunk_recipe(tmp_path, model_dir, **changes) -> tuple[Path, dict]:
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe.update(SHRINK, model_name_or_path=str(model_dir), output_dir=str(tmp_path / "run"), **changes)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path, recipe


def scalar_tags(run_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in run_dir.glob("runs/**/events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    return tags


@pytest.mark.slow
def test_a_shrunk_recipe_checkpoints_at_its_save_steps(warm_policy_dir, tmp_path):
    save_steps = yaml.safe_load(RECIPE.read_text())["save_steps"]
    path, recipe = shrunk_recipe(tmp_path, warm_policy_dir, max_steps=save_steps + 1)
    summary = train.main(*train.parse_args(["--config", str(path)]))
    run = Path(recipe["output_dir"])
    assert summary["steps"] == save_steps + 1
    checkpoints = sorted(p.name for p in run.glob("checkpoint-*"))
    # at save_steps, and at the last step (transformers saves the end of a "steps" run)
    assert checkpoints == [f"checkpoint-{save_steps}", f"checkpoint-{save_steps + 1}"]
    checkpoint = run / f"checkpoint-{save_steps}"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == save_steps
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "bipace_state.json").exists()  # full model
    assert not (checkpoint / "adapter_config.json").exists()  # the recipe trains every parameter, no LoRA
    # the recipe's tracker received the run's metrics
    assert {"train/episode/success_rate", "train/loss", "train/advantage/std"} <= scalar_tags(run)
    # and its rollout dumps are there: every 10th step's episodes, and the evaluations'
    dumps = sorted(p.name for p in (run / "rollouts").iterdir())
    assert dumps == ["eval-before-step-000000.jsonl", f"eval-final-step-{save_steps + 1:06d}.jsonl",
                     "step-000010.jsonl", "step-000020.jsonl"]
    # the run ends with its report, which shows every dumped episode
    assert summary["report"] == str(run / "report.html")
    episodes = sum(len(p.read_text().splitlines()) for p in (run / "rollouts").glob("*.jsonl"))
    assert Path(summary["report"]).read_text().count('<details class="episode"') == episodes


@pytest.mark.slow
def test_a_recipe_run_ends_cleanly_under_accelerate_launch(warm_policy_dir, tmp_path):
    path, recipe = shrunk_recipe(tmp_path, warm_policy_dir, max_steps=2, tasks_per_iteration=2, save_steps=2,
                                 evaluate_before_training=False, rollout_dump_steps=1)
    accelerate = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "mixed_precision": "no",
                  "num_machines": 1, "machine_rank": 0, "rdzv_backend": "static", "same_network": True,
                  "use_cpu": False, "num_processes": 2,  # torchrun launcher; use_cpu in the recipe picks gloo
                  "main_process_port": free_port()}  # not the default 29500, which another job may hold
    config = tmp_path / "accelerate.yaml"
    config.write_text(yaml.safe_dump(accelerate))
    job = tmp_path / "job.py"
    job.write_text(
        "import json, os, sys, torch.distributed as dist\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from bipace_trainer.cli import train\n"
        "summary = train.main(*train.parse_args(sys.argv[1:]))\n"
        f"out = open({str(tmp_path)!r} + '/rank' + os.environ['RANK'] + '.json', 'w')\n"
        "json.dump({'summary': summary, 'group_alive': dist.is_initialized()}, out)\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(job), "--config", str(path)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["summary"]["steps"] == 2 for r in ranks)
    assert not any(r["group_alive"] for r in ranks)  # main() destroyed the process group on every rank
    run = Path(recipe["output_dir"])
    assert (run / "checkpoint-2").is_dir() and "train/loss" in scalar_tags(run)
    # the dumps gather both ranks' episodes into one file
    episodes = [json.loads(line) for line in (run / "rollouts" / "step-000002.jsonl").read_text().splitlines()]
    assert len(episodes) == 2 * 2 and {e["rank"] for e in episodes} == {0, 1}
    assert len({e["episode"] for e in episodes}) == 4  # episode ids are unique across ranks
    final = [json.loads(line) for line in (run / "rollouts" / "eval-final-step-000002.jsonl").read_text().splitlines()]
    assert len(final) == len(TinyEnv.tasks("valid", size=4)) and {e["rank"] for e in final} == {0, 1}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trackio") is None, reason="trackio is not installed (pip install -e .[tracking])")
def test_a_recipe_run_reports_to_trackio_with_the_completions_table(warm_policy_dir, tmp_path):
    path, recipe = shrunk_recipe(tmp_path, warm_policy_dir, max_steps=2, save_strategy="no", report_to="trackio",
                                 project="bipace-test", run_name="shrunk", log_completions=True, num_completions_to_print=1)
    env = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", TRACKIO_DIR=str(tmp_path / "trackio"))
    done = subprocess.run([sys.executable, "train.py", "--config", str(path)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Run finished" in done.stdout  # the tracker was finished at the end of the run
    with sqlite3.connect(tmp_path / "trackio" / "bipace-test.db") as db:
        logged = [json.loads(blob) for (blob,) in db.execute("select metrics from metrics where run_name = 'shrunk'")]
    keys = {key for entry in logged for key in entry}
    assert {"train/episode/success_rate", "train/loss", "completions"} <= keys
    table = next(entry["completions"] for entry in logged if "completions" in entry)  # TRL's table, one row per step
    rows = table["_value"]  # one row per env step
    # TRL's columns, readable; the rest of a step (task, turn, action, return, cell...) is in the rollout dumps
    assert rows and {"prompt", "completion", "reward", "advantage"} <= set(rows[0]) and "task" not in rows[0]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (pip install -e .[tracking])")
def test_train_py_finishes_the_wandb_run(warm_policy_dir, tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")  # no account, no network: the run is written to WANDB_DIR
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    path, recipe = shrunk_recipe(tmp_path, warm_policy_dir, max_steps=1, save_strategy="no", report_to="wandb",
                                 evaluate_before_training=False)
    train.main(*train.parse_args(["--config", str(path)]))
    assert wandb.run is None  # transformers leaves it open (for the model card); train.py finishes it
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))  # and the run was recorded
