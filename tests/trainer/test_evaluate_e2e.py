"""`bipace-eval` on the tiny warm-started model: one run, an interrupted run resumed without
replaying its finished chunks, a paired comparison, and two processes under `accelerate launch`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bipace_trainer.cli import evaluate
from bipace_trainer.reports.show import load_episodes

from .test_distributed import ROOT, cpu_config
from .tiny_setup import make_model, make_tokenizer

# 2 held-out tasks of the size-4 line × 2 episodes each = 4 per seed, in chunks of 2: 4 chunks, 8 episodes
FLAGS = ["--env", "tiny", "--env_kwargs", '{"size": 4}', "--split", "valid", "--max_turns", "4", "--history_length", "1",
         "--max_completion_length", "16", "--seeds", "1", "2", "--episodes_per_task", "2", "--chunk_size", "2",
         "--no_progress", "--use_cpu"]  # fmt: skip


def outcomes(result, model=0):
    return [(e["task_id"], e["seed"], e["repeat"], e["won"], e["turns"]) for e in episodes_of(result, model)]


def episodes_of(result, model=0):
    return result["episodes"][model]


def run_eval(argv, progress=None):
    settings = evaluate.parse_args(argv)
    lines = []
    result = evaluate.run(settings, progress=progress or lines.append)
    episodes = []
    for model in result["models"]:
        path = Path(settings.output_dir) / model["label"] / evaluate.EPISODES_FILE
        chunks = [json.loads(line) for line in path.read_text().splitlines()]
        chunks.sort(key=lambda c: (c["seed"], c["chunk"]))
        episodes.append([e | {"seed": c["seed"]} for c in chunks for e in c["episodes"]])
    return result | {"episodes": episodes, "lines": lines}


@pytest.mark.slow
def test_one_run_then_an_interrupted_run_resumes_to_the_same_episodes(warm_policy_dir, tmp_path):
    model = str(warm_policy_dir)
    whole = run_eval([model, *FLAGS, "--output_dir", str(tmp_path / "whole")])
    summary = whole["models"][0]["splits"]["valid"]
    episodes = episodes_of(whole)
    assert len(episodes) == summary["overall"]["episodes"] == 8
    assert summary["overall"]["successes"] == sum(e["won"] for e in episodes)
    assert {(e["task_id"], e["seed"], e["repeat"]) for e in episodes} == {
        (t, s, r) for t in {e["task_id"] for e in episodes} for s in (1, 2) for r in (0, 1)}
    assert set(summary["overall"]["per_seed"]) == {"1", "2"}
    assert set(summary["per_type"]) == {f"distance={e['attributes']['distance']}" for e in episodes}
    # each chunk's saved outcomes are its dump's, which the report reads
    dumps = sorted((tmp_path / "whole" / "model" / "rollouts").glob("eval-valid-seed*-chunk*-step-000000.jsonl"))
    assert len(dumps) == 4
    assert sum(e["won"] for p in dumps for e in load_episodes(p)) == summary["overall"]["successes"]
    written = json.loads((tmp_path / "whole" / evaluate.RESULT_FILE).read_text())
    assert written["models"][0]["splits"]["valid"]["overall"]["successes"] == summary["overall"]["successes"]
    assert "| all |" in (tmp_path / "whole" / evaluate.MARKDOWN_FILE).read_text()

    # interrupted after its second chunk was saved (the progress line follows the save) ...
    def stop_after_two(line):
        if "chunk 2/4" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_eval([model, *FLAGS, "--output_dir", str(tmp_path / "cut")], progress=stop_after_two)
    saved = (tmp_path / "cut" / "model" / evaluate.EPISODES_FILE).read_text().splitlines()
    assert len(saved) == 2
    # ... resumed: plays the two missing chunks only, and ends where the uninterrupted run did
    resumed = run_eval([model, *FLAGS, "--output_dir", str(tmp_path / "cut")])
    assert resumed["lines"][0] == "model: 2 of 4 chunks already played"
    assert [line.split(" (")[0] for line in resumed["lines"][1:]] == ["model: chunk 1/2", "model: chunk 2/2"]
    assert len((tmp_path / "cut" / "model" / evaluate.EPISODES_FILE).read_text().splitlines()) == 4
    assert outcomes(resumed) == outcomes(whole)  # each chunk samples under its own fixed seed
    # a third run replays nothing
    again = run_eval([model, *FLAGS, "--output_dir", str(tmp_path / "cut")])
    assert again["lines"] == ["model: 4 of 4 chunks already played"] and outcomes(again) == outcomes(whole)


@pytest.mark.slow
def test_two_models_are_compared_on_the_same_tasks_and_seeds(warm_policy_dir, tmp_path):
    tokenizer = make_tokenizer()
    untrained = tmp_path / "untrained"
    make_model(tokenizer, seed=1).save_pretrained(untrained)
    tokenizer.save_pretrained(untrained)
    result = run_eval([str(warm_policy_dir), str(untrained), *FLAGS, "--output_dir", str(tmp_path / "pair")])
    first, second = (m["splits"]["valid"]["overall"] for m in result["models"])
    keys = [[(e["task_id"], e["seed"], e["repeat"]) for e in episodes] for episodes in result["episodes"]]
    assert sorted(keys[0]) == sorted(keys[1]) and len(keys[0]) == 8  # the same panel for both
    pair = result["paired"][0]
    assert (pair["first"], pair["second"], pair["pairs"], pair["tasks"]) == ("model", "untrained", 8, 2)
    # a balanced panel: the mean of per-task differences is the difference of the success rates
    assert pair["difference"] == pytest.approx(first["success_rate"] - second["success_rate"])
    assert "## Paired difference" in (tmp_path / "pair" / evaluate.MARKDOWN_FILE).read_text()


@pytest.mark.slow
def test_two_processes_play_a_slice_each_and_gather(warm_policy_dir, tmp_path):
    config = cpu_config("ddp", tmp_path / "accelerate.yaml")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", PYTHONPATH=str(ROOT))
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "-m", "bipace_trainer.cli.evaluate",
           str(warm_policy_dir), *FLAGS, "--output_dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / evaluate.RESULT_FILE).read_text())
    assert result["models"][0]["splits"]["valid"]["overall"]["episodes"] == 8
    chunks = [json.loads(line) for line in (out / "model" / evaluate.EPISODES_FILE).read_text().splitlines()]
    assert len(chunks) == 4 and all(len(c["episodes"]) == 2 for c in chunks)  # written once, by the main process
    ranks = {e["rank"] for p in (out / "model" / "rollouts").glob("*.jsonl") for e in load_episodes(p)}
    assert ranks == {0, 1}  # each chunk of 2 episodes was split over both processes
    assert proc.stdout.count("| all |") == 1  # one table, from the main process


@pytest.mark.slow
def test_a_trained_runs_output_dir_is_evaluated_as_the_run_evaluated_itself(warm_policy_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from bipace_trainer import BiPACETrainer
    from bipace_trainer.models import load_tokenizer

    from .tiny_setup import tiny_args

    args = tiny_args(tmp_path / "run", max_steps=1, eval_tasks=2, eval_temperature=0.2, max_turns=3, preset="grpo")
    trainer = BiPACETrainer(AutoModelForCausalLM.from_pretrained(warm_policy_dir), args=args,
                            processing_class=load_tokenizer(warm_policy_dir))
    trainer.train()
    trainer.save_model()
    trainer.close_envs()
    final = trainer.eval_history[-1]
    assert final["tag"] == "final" and "eval/settings" not in trainer.state.log_history[-1]  # kept, not logged
    got = evaluate.parse_args([str(tmp_path / "run"), "--use_cpu"])
    assert (got.env, got.env_kwargs, got.split, got.max_turns, got.history_length, got.max_completion_length,
            got.temperature, got.tasks, got.episodes_per_task) == (
        "tiny", args.env_kwargs, [final["split"]], 3, args.history_length, args.max_completion_length, 0.2, 2, 1)


@pytest.mark.slow
def test_a_runs_output_dir_replays_its_final_evaluation_to_the_same_episodes(warm_policy_dir, tmp_path, capsys):
    """`bipace-eval RUN_DIR` plays the run's final evaluation again: a LoRA run as the main job's, whose
    final evaluation samples at 1.0 (the replies differ from seed to seed), gives the same replies, turn by
    turn, and prints the summary's held-out figure twice."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from bipace_trainer import BiPACETrainer
    from bipace_trainer.models import load_tokenizer

    from .tiny_setup import LORA, tiny_args

    args = tiny_args(tmp_path / "run", max_steps=1, eval_tasks=2, eval_rollouts_per_task=2, eval_temperature=1.0,
                     max_turns=3, preset="grpo", rollout_dump_steps=1, seed=5)  # fmt: skip
    trainer = BiPACETrainer(AutoModelForCausalLM.from_pretrained(warm_policy_dir), args=args,
                            processing_class=load_tokenizer(warm_policy_dir), peft_config=LoraConfig(**LORA))  # fmt: skip
    trainer.train()
    trainer.save_model()
    trainer.close_envs()
    final = trainer.eval_history[-1]
    run_dir = str(tmp_path / "run")

    def replies(path):
        return sorted((e["task_id"], [turn["reply"] for turn in e["turns"]]) for e in load_episodes(path))

    capsys.readouterr()  # the training's logs
    assert evaluate.main([run_dir, "--use_cpu", "--no_progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("seed 5, the one the run's final evaluation sampled with")  # after the threads and settings
    played = replies(tmp_path / "run" / "bipace_eval" / "run" / "rollouts" / "eval-valid-seed5-chunk0000-step-000000.jsonl")
    assert played == replies(tmp_path / "run" / "rollouts" / "eval-final-step-000001.jsonl")
    figure = f"{final['success_rate']:.3f} ({round(final['success_rate'] * 4)} of 4 episodes"
    assert [line.split(": ", 1)[1].startswith(figure) for line in out[-2:]] == [True, True], out[-2:]
    # another seed samples other replies: the match above is the seed's, not the model's certainty
    assert evaluate.main([run_dir, "--use_cpu", "--no_progress", "--seeds", "6"]) == 0
    assert "asked for (the run's final evaluation sampled seed 5" in capsys.readouterr().out
    other = replies(tmp_path / "run" / "bipace_eval" / "run" / "rollouts" / "eval-valid-seed6-chunk0000-step-000000.jsonl")
    assert other != played
