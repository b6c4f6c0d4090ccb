"""The training path with the real vLLM engine (CPU build), in its own venv.

Builds the venv once (tests/vllm/make_venv.sh, ~3 min and ~3.8 GB on a fresh machine),
then runs tests/vllm/vllm_job.py there: 2 LoRA steps of `bipace_q` with
`use_vllm=True, vllm_mode="colocate"` on the tiny env, evaluations before and after;
tests/vllm/eval_job.py: `bipace-eval --use_vllm` on the model the job warm-started (1–2 min
more); and tests/vllm/tool_job.py: TRL's `environment_factory` path (a tool-calling policy, a user
reward function) for 2 steps under vLLM colocate (~1.5 min more, a third of it the warm start); and
tests/vllm/stream_job.py twice: `rollout_mode="continuous"` through the engine's own continuous
batching (`rollout.vllm_stream`), 2 LoRA steps each (~4 min for both).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def venv_python():
    """The python of the vLLM venv (tests/vllm/make_venv.sh builds it once)."""
    if sys.platform != "linux":
        pytest.skip("vLLM's CPU build is for Linux")
    build = subprocess.run(
        ["bash", str(ROOT / "tests" / "vllm" / "make_venv.sh")], capture_output=True, text=True, timeout=1200
    )
    assert build.returncode == 0, f"building the vLLM venv failed:\n{build.stderr[-4000:]}"
    return build.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def engine_job(tmp_path_factory, venv_python):
    """The job's result, its work dir (the warm-started model it saved is `model/`) and the venv's python."""
    python = venv_python
    work = tmp_path_factory.mktemp("vllm_job")
    job = subprocess.run(
        [python, str(ROOT / "tests" / "vllm" / "vllm_job.py"), "--out", str(work / "result.json"), "--workdir", str(work)],
        capture_output=True, text=True, timeout=1200, env=ENV, cwd=ROOT,
    )
    assert job.returncode == 0, f"the vLLM job failed:\n{job.stdout[-3000:]}\n{job.stderr[-6000:]}"
    return json.loads((work / "result.json").read_text()), work, python


@pytest.fixture(scope="module")
def engine_run(engine_job):
    return engine_job[0]


@pytest.mark.slow
def test_the_loss_runs_with_the_importance_sampling_correction(engine_run):
    trained = engine_run["generations"][:2]  # the third ran with the correction switched off
    for generation in trained:
        assert generation["nonzero_advantages"] > 0 and not generation["skip_update"]
        # TRL's default mode, sequence_mask: one ratio per sample
        assert generation["is_ratio_shape"] == [generation["completion_shape"][0], 1]
        assert generation["sampling_logprobs_per_step"]
    assert engine_run["lora_changed"]
    assert len(engine_run["losses"]) == 2 and all(loss != 0 for loss in engine_run["losses"])
    for metrics in engine_run["is_metrics"]:
        assert 0 < metrics["sampling/importance_sampling_ratio/min"] <= metrics["sampling/importance_sampling_ratio/max"]
        assert metrics["sampling/sampling_logp_difference/mean"] >= 0
    # --vllm_importance_sampling_correction false: no ratio, no sampling logprobs in the batch
    assert engine_run["generations"][2]["is_ratio_shape"] is None
    assert "importance_sampling_ratio" not in engine_run["uncorrected_keys"]
    assert "old_per_token_logps" in engine_run["uncorrected_keys"]


@pytest.mark.slow
def test_the_prefix_cache_hit_rate_is_read_back_from_the_engine(engine_run):
    # every prompt token is either encoded or reused (the engine's counts: a turn's dummy
    # prompts included, so at least what the rollout sent), and later turns reuse the KV of
    # the prefix their episode's earlier turn left in the cache
    for entry in engine_run["prefix_cache"]:
        encoded, reused = entry["rollout/prompt_tokens_encoded"], entry["rollout/prompt_tokens_reused"]
        assert encoded + reused >= entry["rollout/prompt_tokens"] > 0
        assert reused > 0 and entry["rollout/prefix_cache_hit_rate"] == pytest.approx(reused / (encoded + reused))


@pytest.mark.slow
def test_hidden_states_come_from_the_old_logprob_pass(engine_run):
    for generation in engine_run["generations"]:
        assert generation["all_steps_have_hidden"]
    # the same states an extra forward pass over the prompts gives
    assert max(engine_run["hidden_gaps"]) < 1e-4


@pytest.mark.slow
def test_weights_move_to_the_engine_once_per_step(engine_run):
    # cumulative pushes after each of the 2 steps (4 turns each): the evaluation before
    # training pushes step 0's weights, step 1 pushes once more; never once per turn
    assert engine_run["weight_syncs"] == [1.0, 2.0]
    probe = engine_run["probe"]

    def gap(a, b):
        return max(abs(x - y) for x, y in zip(probe[a], probe[b]))

    # after a sync the engine scores a fixed completion as the trained policy does (vLLM's
    # CPU kernels: ~0.02 nats); 2 LoRA steps move it too little to tell a sync from none
    assert gap("engine_after", "trainer_after") < 0.05
    # a large, known push of every lora_B (> 2 nats on the probe) tells: before the next
    # sync the engine still scores the old weights, after it the pushed ones
    assert gap("trainer_pushed", "trainer_after") > 2.0
    assert gap("engine_stale", "trainer_pushed") > 1.0
    # (the pushed logits are larger, and so is the engine's rounding: the bound is relative)
    assert gap("engine_pushed", "trainer_pushed") < 0.1 * gap("engine_stale", "trainer_pushed")


@pytest.mark.slow
def test_evaluation_samples_at_the_eval_temperature(engine_run):
    temperatures = {tuple(t) for t in engine_run["temperatures"]}
    assert temperatures == {("train", engine_run["train_temperature"]), ("eval", engine_run["eval_temperature"])}
    assert [e["tag"] for e in engine_run["eval_history"]] == ["before", "final"]
    assert all(e["num_tasks"] > 0 for e in engine_run["eval_history"])


@pytest.mark.slow
def test_bipace_eval_plays_every_episode_with_the_engine_and_resumes(engine_job):
    _, work, python = engine_job
    out = work / "eval"
    flags = [
        str(work / "model"), "--env", "tiny", "--env_kwargs", json.dumps({"size": 4}), "--seeds", "1", "2",
        "--episodes_per_task", "3", "--chunk_size", "4", "--max_turns", "4", "--max_completion_length", "16",
        "--history_length", "1", "--temperature", "1.0", "--use_vllm", "--vllm_max_model_length", "1024",
        "--output_dir", str(out), "--no_progress",
    ]  # fmt: skip
    job = subprocess.run(
        [python, str(ROOT / "tests" / "vllm" / "eval_job.py"), "--out", str(work / "eval.json"), "--", *flags],
        capture_output=True, text=True, timeout=900, env=ENV, cwd=ROOT,
    )
    assert job.returncode == 0, f"bipace-eval --use_vllm failed:\n{job.stdout[-3000:]}\n{job.stderr[-6000:]}"
    counted = json.loads((work / "eval.json").read_text())
    first, rerun, resumed = counted["runs"]

    # 2 valid tasks x 3 repeats x 2 seeds, in chunks of <= 4: 2 chunks per seed, each task 3 times per seed
    chunks = [json.loads(line) for line in (out / "model" / "episodes.jsonl").read_text().splitlines()]
    assert [(c["seed"], c["chunk"], len(c["episodes"])) for c in chunks] == [(1, 0, 4), (1, 1, 2), (2, 0, 4), (2, 1, 2)]
    per_task: dict[tuple, int] = {}
    for c in chunks:
        for e in c["episodes"]:
            per_task[(e["task_id"], c["seed"])] = per_task.get((e["task_id"], c["seed"]), 0) + 1
    assert sorted(per_task.values()) == [3] * 4 and len({task for task, _ in per_task}) == 2

    # every turn of every episode was one prompt to the vLLM engine; transformers generated nothing
    turns = sum(e["turns"] for c in chunks for e in c["episodes"])
    assert first["engines"] == 1 and first["engine_prompts"] == turns > 0 and first["hf_generate_calls"] == 0
    # the engine ran the warm-started weights: mostly valid replies (a random model's are not)
    dumps = {f.name: [json.loads(line) for line in f.read_text().splitlines()]
             for f in (out / "model" / "rollouts").glob("*.jsonl")}  # fmt: skip
    valid = [t["valid"] for episodes in dumps.values() for e in episodes for t in e["turns"]]
    assert len(dumps) == 4 and len(valid) == turns and sum(valid) > len(valid) / 2
    by_seed = [[t["reply"] for name in sorted(dumps) if f"seed{s}-" in name for e in dumps[name] for t in e["turns"]]
               for s in (1, 2)]  # fmt: skip
    assert by_seed[0] != by_seed[1]

    # a rerun finds every chunk and replays none: no engine, no generation, no new line
    assert {k: v for k, v in rerun.items() if k != "seconds"} == dict.fromkeys(rerun.keys() - {"seconds"}, 0)
    assert "model: 4 of 4 chunks already played" in job.stdout
    # killed during its last chunk: the resumed run replays that chunk alone, in a fresh engine (the
    # first one freed), under the chunk's own seed: the same episodes as the uninterrupted run
    last_turns = sum(e["turns"] for e in counted["cut"]["model"]["episodes"])
    assert resumed["engines"] == 1 and resumed["alive_at_build"] == 0 and resumed["engine_prompts"] == last_turns
    assert "model: 3 of 4 chunks already played" in job.stdout
    assert json.loads((out / "model" / "episodes.jsonl").read_text().splitlines()[-1]) == counted["cut"]["model"]
    assert counted["resumed_replies"]["model"] == counted["cut_replies"]["model"] and counted["cut_replies"]["model"]

    result = json.loads((out / "bipace_eval.json").read_text())
    assert result["protocol"]["generation"] == "vllm colocate"
    overall = result["models"][0]["splits"]["valid"]["overall"]
    assert overall["episodes"] == 12 and set(overall["per_seed"]) == {"1", "2"}
    assert overall["successes"] == sum(e["won"] for c in chunks for e in c["episodes"])
    markdown = (out / "bipace_eval.md").read_text()
    assert "generated with vllm colocate" in markdown and f"| all | {overall['success_rate']:.3f} (" in markdown
    assert "/12, " in markdown
    print(f"bipace-eval --use_vllm: {first['seconds']:.0f} s, rerun {rerun['seconds']:.2f} s, resumed {resumed['seconds']:.0f} s")


@pytest.mark.slow
def test_trl_environment_factory_trains_and_evaluates_with_the_engine(venv_python, tmp_path):
    job = subprocess.run(
        [venv_python, str(ROOT / "tests" / "vllm" / "tool_job.py"), "--out", str(tmp_path / "result.json"),
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=900, env=ENV, cwd=ROOT,
    )  # fmt: skip
    assert job.returncode == 0, f"the vLLM tool job failed:\n{job.stdout[-3000:]}\n{job.stderr[-6000:]}"
    run = json.loads((tmp_path / "result.json").read_text())

    # every reply of training and evaluation came from the engine; transformers generated nothing
    assert run["counts"]["engine_calls"] > 0 and run["counts"]["hf_generate_calls"] == 0
    # 2 steps, a generation each, both trained
    assert run["global_step"] == 2 and len(run["rollouts"]) == 2
    assert len(run["losses"]) == 2 and all(loss != 0 for loss in run["losses"])
    assert all(r["nonzero_advantages"] > 0 for r in run["rollouts"])
    steps = [s for r in run["rollouts"] for s in r["steps"]]
    # the policy called the tool in the engine's replies, and episodes went on after a tool result
    calls = [json.loads(s["action"]) for s in steps if s["action"]]
    assert calls and all(call[0]["name"] == "act" and "command" in call[0]["arguments"] for call in calls)
    assert any(s["t"] > 0 and s["action"] for s in steps)
    # each step carries the engine's sampling log-prob of every completion token, and the loss's
    # importance-sampling correction ran on them
    assert all(s["logprobs"] == s["completion_tokens"] > 0 for s in steps)
    assert len(run["is_ratio_mean"]) == 2 and all(r > 0 for r in run["is_ratio_mean"])
    # weights pushed once per step: the evaluation before training pushes step 0's, step 2's
    # rollout the weights step 1 trained
    assert run["weight_syncs"] == [1.0, 2.0]
    assert [(e["tag"], e["num_tasks"]) for e in run["eval_history"]] == [("before", 2), ("final", 2)]
    # the dumps of both steps and both evaluations hold each turn's parsed tool call, or the reply as
    # the model wrote it when it held none (after two steps at this learning rate the tiny policy may
    # write only broken calls: on one host type its final evaluation did)
    assert sorted(run["dumps"]) == ["eval-before-step-000000.jsonl", "eval-final-step-000002.jsonl",
                                    "step-000001.jsonl", "step-000002.jsonl"]  # fmt: skip
    for name, episodes in run["dumps"].items():
        turns = [t for e in episodes for t in e["turns"]]
        assert turns, name
        for turn in turns:
            if turn["action"]:
                assert all(call["name"] == "act" for call in json.loads(turn["action"])), name
            else:
                assert turn["reply"], name
    # the warm start calls its tool: its evaluation and the first rollouts hold parsed calls
    for name in ("eval-before-step-000000.jsonl", "step-000001.jsonl"):
        assert any(t["action"] for e in run["dumps"][name] for t in e["turns"]), name
    print(f"warm start {run['warm_seconds']:.0f} s, training and evaluations {run['train_seconds']:.0f} s")


def run_stream_job(python, work: Path) -> dict:
    out = work / f"result-{len(list(work.glob('result-*.json')))}.json"
    job = subprocess.run(
        [python, str(ROOT / "tests" / "vllm" / "stream_job.py"), "--out", str(out), "--workdir", str(work)],
        capture_output=True, text=True, timeout=900, env=ENV, cwd=ROOT,
    )  # fmt: skip
    assert job.returncode == 0, f"the vLLM stream job failed:\n{job.stdout[-3000:]}\n{job.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.slow
def test_continuous_rollouts_stream_through_the_engine_and_repeat_under_a_seed(engine_job, tmp_path):
    _, work, venv_python = engine_job
    # vllm_job.py saved the model stream_job.py would warm-start (the same make_model and warm_start)
    shutil.copytree(work / "model", tmp_path / "model")
    first = run_stream_job(venv_python, tmp_path)
    # the stream played every rollout, training and evaluation: no call-by-call generation at all
    assert first["streams_used"] and first["generate_turn_calls"] == 0
    assert len(first["rollouts"]) == 2 and len(first["losses"]) == 2 and all(loss != 0 for loss in first["losses"])
    assert first["weight_syncs"] == [1.0, 2.0]  # once per step, as call by call
    # the stream samples with TRL's colocate SamplingParams (training and evaluation temperature)
    assert all(p["trl"] == p["stream"] for p in first["sampling_params"]), first["sampling_params"]
    assert "temperature=0.4" in first["sampling_params"][1]["stream"]
    assert [e["tag"] for e in first["eval_history"]] == ["before", "final"]
    for rollout, metrics in zip(first["rollouts"], first["metrics"]):
        steps = rollout["steps"]
        # records complete: one per env step, each with the engine's logprob of every completion
        # token and the hidden state of the old-logprob pass; the estimator had signal and the
        # importance-sampling correction ran
        assert len(steps) == sum(rollout["episode_lengths"]) > 0 and not any(rollout["episodes_failed"])
        assert all(s["completion_ids"] and s["logprobs"] == len(s["completion_ids"]) for s in steps)
        assert rollout["hidden_rows"] == len(steps)
        assert [(s["t"], s["traj"]) for s in steps] == sorted((s["t"], s["traj"]) for s in steps)  # lockstep's order
        assert rollout["nonzero_advantages"] > 0 and rollout["has_is_ratio"]
        # engine steps, not calls: each reply took several, and the metric says so
        assert rollout["generate_calls"] == rollout["engine_steps"] == metrics["rollout/engine_steps"] > len(steps)
        assert metrics["rollout/prompt_tokens_encoded"] + metrics["rollout/prompt_tokens_reused"] >= metrics["rollout/prompt_tokens"]
        assert metrics["rollout/prompt_tokens_reused"] > 0  # a group's copies and the episodes' history hit the cache
    # in some engine step a request of one turn decoded beside a request of the next turn of
    # another episode: the engine batched across turns, which a call-by-call rollout never does
    for stream in (1, 2):  # the training rollouts (0 and 3 are the evaluations)
        entered = {tuple(key): at for s, at, key, _ in first["entered"] if s == stream}
        left = {tuple(key): at for s, at, key in first["left"] if s == stream}
        assert entered.keys() == left.keys()  # every request finished
        turns_at = [{t for (traj, t), at in entered.items() if at < step <= left[(traj, t)]}
                    for step in range(1, max(left.values()) + 1)]
        assert any(len(turns) > 1 for turns in turns_at), stream
    # every request had its own seed, and copies of one prompt sampled different replies
    seeds = [seed for *_, seed in first["entered"]]
    assert len(set(seeds)) == len(seeds)
    turn0 = [tuple(s["completion_ids"]) for s in first["rollouts"][0]["steps"] if s["t"] == 0]
    assert len(set(turn0)) > 1

    second = run_stream_job(venv_python, tmp_path)  # the same seed: the same requests, replies and rollouts
    assert second["entered"] == first["entered"]
    for a, b in zip(first["rollouts"], second["rollouts"]):
        assert a["steps"] == b["steps"] and a["engine_steps"] == b["engine_steps"]
    assert second["losses"] == pytest.approx(first["losses"])
