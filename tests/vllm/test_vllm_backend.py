"""What the multi-turn rollout adds to TRL's vLLM path (bipace_trainer/rollout/vllm_backend.py),
without the engine: the importance-sampling ratio against hand-computed values, server
mode on 2 processes through TRL's own gather/slice code, and one weight push per
training step through TRL's own colocate sleep-mode code. The real engine runs in
tests/vllm/test_vllm_engine.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bipace_trainer.rollout.vllm_backend import (
    IS_MODES,
    WeightSyncs,
    equal_prompt_counts,
    importance_sampling_metrics,
    importance_sampling_ratio,
)
from tests.trainer.test_distributed import cpu_config

ROOT = Path(__file__).resolve().parents[2]
NAN = float("nan")


def test_ratio_matches_hand_computed_values_in_every_mode():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, 9.0]])
    sampling = torch.tensor([[-1.5, -1.0, NAN], [-0.1, -1.2, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # per-token log differences: row 0: 0.5, -1.0, NaN -> 0; row 1: 0, 1.0, masked -> 0
    token = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0], [1.0, math.e, 1.0]])
    sequence = torch.tensor([[math.exp(-0.5)], [math.e]])
    cases = {
        ("token_truncate", None, 2.0): token.clamp(max=2.0),
        ("token_mask", 0.5, 2.0): torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 1.0]]) * token,
        ("sequence_truncate", 0.7, 3.0): torch.tensor([[0.7], [math.e]]),
        ("sequence_mask", None, 2.0): torch.tensor([[math.exp(-0.5)], [0.0]]),
        ("sequence_mask", None, 3.0): sequence,
    }
    for (mode, low, high), expected in cases.items():
        ratio = importance_sampling_ratio(old, sampling, mask, mode, low, high)
        torch.testing.assert_close(ratio, expected, msg=f"{mode} [{low}, {high}]")


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4),
    cols=st.integers(1, 5),
    mode=st.sampled_from(IS_MODES),
    low=st.one_of(st.none(), st.floats(0.0, 1.0)),
    high=st.one_of(st.none(), st.floats(1.0, 5.0)),
    seed=st.integers(0, 2**16),
)
def test_ratio_agrees_with_a_loop_over_tokens(rows, cols, mode, low, high, seed):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=generator) * 3
    sampling = -torch.rand(rows, cols, generator=generator) * 3
    sampling[torch.rand(rows, cols, generator=generator) < 0.1] = NAN
    mask = (torch.rand(rows, cols, generator=generator) < 0.8).long()
    ratio = importance_sampling_ratio(old, sampling, mask, mode, low, high)
    for i in range(rows):
        diffs = [
            0.0 if (not mask[i, t] or math.isnan(sampling[i, t])) else float(old[i, t] - sampling[i, t]) for t in range(cols)
        ]
        values = [math.exp(sum(diffs))] if mode.startswith("sequence") else [math.exp(d) for d in diffs]
        for t, value in enumerate(values):
            inside = (low is None or value >= low) and (high is None or value <= high)
            if mode.endswith("truncate"):
                value = min(max(value, low if low is not None else -math.inf), high if high is not None else math.inf)
            elif not inside:
                value = 0.0
            assert float(ratio[i, t]) == pytest.approx(value, rel=1e-5, abs=1e-6)


def test_ratio_rejects_an_unknown_mode_and_mismatched_shapes():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        importance_sampling_ratio(x, x, x, "token")
    with pytest.raises(ValueError, match="shapes differ"):
        importance_sampling_ratio(x, torch.zeros(2, 2), x)


def test_metrics_ignore_masked_and_unscored_tokens():
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    sampling = torch.tensor([[-1.5, NAN, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    ratio = importance_sampling_ratio(old, sampling, mask, "token_truncate", None, 10.0)
    metrics = importance_sampling_metrics(old, sampling, mask, ratio)
    assert float(metrics["sampling/sampling_logp_difference/mean"]) == pytest.approx(0.5)
    assert float(metrics["sampling/sampling_logp_difference/max"]) == pytest.approx(0.5)
    assert float(metrics["sampling/importance_sampling_ratio/min"]) == pytest.approx(1.0)  # the NaN token: ratio 1
    assert float(metrics["sampling/importance_sampling_ratio/max"]) == pytest.approx(math.exp(0.5))


def test_equal_prompt_counts_pads_with_the_dummy_and_refuses_to_drop():
    assert equal_prompt_counts([[1, 2]], 3, [9]) == [[1, 2], [9], [9]]
    assert equal_prompt_counts([[1], [2]], 2, [9]) == [[1], [2]]
    with pytest.raises(ValueError, match="exceed"):
        equal_prompt_counts([[1], [2]], 1, [9])


class _Engine:
    """Stands in for `vllm.LLM` under TRL's colocate `generate`: echoes, logs sleep/wake."""

    def __init__(self, events):
        self.events = events

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        self.events.append("generate")
        out = types.SimpleNamespace(token_ids=[7, 8], logprobs=[{7: types.SimpleNamespace(logprob=-0.1, rank=1)},
                                                                {8: types.SimpleNamespace(logprob=-0.2, rank=1)}])
        return [types.SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=[out]) for p in prompts]

    def sleep(self, level):
        self.events.append("sleep")

    def wake_up(self, tags):
        self.events.append("wake:" + ",".join(tags))

    def reset_prefix_cache(self):
        pass


@pytest.mark.parametrize("sleep_mode", [False, True])
def test_one_weight_push_per_rollout_in_colocate_mode(sleep_mode, monkeypatch):
    """TRL's colocate `generate` with sleep mode re-pushes the weights on every call (sleep
    level 2 discards them); a rollout of 5 turns inside `WeightSyncs.awake` pushes once."""
    from accelerate import Accelerator
    from trl.generation import vllm_generation as module

    monkeypatch.setattr(module, "SamplingParams", lambda **kwargs: kwargs, raising=False)
    monkeypatch.setattr(module.VLLMGeneration, "_init_vllm", lambda self: None)
    model = torch.nn.Linear(2, 2)
    generation = module.VLLMGeneration(model=model, accelerator=Accelerator(cpu=True), processing_class=None,
                                       mode="colocate", enable_sleep_mode=sleep_mode, logprobs=0)
    events: list[str] = []
    generation.llm = _Engine(events)
    generation._llm_weights_sleeping = sleep_mode  # TRL puts a sleep-mode engine to sleep at init
    monkeypatch.setattr(module.VLLMGeneration, "sync_weights", lambda self: events.append("push"))
    syncs = WeightSyncs(generation)

    def rollout(turns):
        with syncs.awake() as pushed:
            for _ in range(turns):
                _, completions, logprobs, _ = generation.generate([[1, 2, 3]], None, num_generations=1)
                assert completions == [[7, 8]] and logprobs == [[[-0.1], [-0.2]]]
        return pushed

    pushed = rollout(5)
    if sleep_mode:
        assert pushed and syncs.count == 1
        assert events == ["push", "wake:kv_cache"] + ["generate"] * 5 + ["sleep"]
        assert generation.enable_sleep_mode and generation._llm_weights_sleeping  # restored
        rollout(5)
        assert syncs.count == 2  # the next rollout pushes again: sleep discarded the weights
    else:
        assert not pushed and syncs.count == 0 and events == ["generate"] * 5
        # without the scope, TRL's generate re-pushes nothing either: no sleep, no discard

    if sleep_mode:  # what TRL alone does: one push per generate call
        events.clear()
        for _ in range(3):
            generation.generate([[1, 2, 3]], None, num_generations=1)
        assert events.count("push") == 3


def run_server_job(tmp_path, rollout_mode: str) -> list[dict]:
    config = cpu_config("ddp", tmp_path / "accelerate.yaml")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", PYTHONPATH=str(ROOT))
    job = ROOT / "tests" / "vllm" / "server_job.py"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(job), "--out", str(tmp_path),
           "--rollout_mode", rollout_mode]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_server_mode_on_two_processes_keeps_completions_with_their_prompts(tmp_path):
    ranks = run_server_job(tmp_path, "lockstep")
    # the ranks asked for different numbers of completions in the same call ...
    assert any(a != b for a, b in zip(ranks[0]["prompt_counts"], ranks[1]["prompt_counts"]))
    # ... and every completion still came back to its own prompt, with its sampling logprobs
    for rank in ranks:
        assert rank["steps_checked"] > 0 and rank["mismatches"] == 0
        assert rank["global_step"] == 2
        assert all(shape[1] == 1 for shape in rank["is_ratio"])
    # the server saw equal shares: every call carries 2 x the larger count
    counts = list(zip(ranks[0]["prompt_counts"], ranks[1]["prompt_counts"]))
    assert ranks[0]["server_prompts_per_call"] == [2 * max(max(a, b), 1) for a, b in counts]
    # weights: once per step with generation (steps 0 and 1) and once for the final
    # evaluation at step 2, on both ranks; never once per turn (4 turns a rollout)
    assert ranks[0]["weight_pushes"] == 3 and ranks[1]["weight_syncs"] == ranks[0]["weight_syncs"] == 3


@pytest.mark.slow
def test_the_server_stream_on_two_processes_sends_each_ranks_own_requests(tmp_path):
    """Continuous mode in server mode: no gather, no padding; each rank sends one request per
    env step of its own episodes, and gets back the completions of its own prompts."""
    ranks = run_server_job(tmp_path, "continuous")
    for rank in ranks:
        assert rank["streamed"] and rank["prompt_counts"] == []  # no call by call at all
        assert rank["steps_checked"] > 0 and rank["mismatches"] == 0 and rank["global_step"] == 2
        assert rank["server_prompts_per_call"] == []
        # one request per step record (training) plus the final evaluation's: nothing padded
        assert rank["requests"] >= rank["steps_checked"]
    # rank 0's episodes end after one turn: it sent fewer requests than rank 1, on its own
    assert ranks[0]["requests"] < ranks[1]["requests"]
    # weights pushed by the main process, once per step with generation and once for the final
    # evaluation (then every rank waited at the barrier); the other rank walked its parameters along
    assert ranks[0]["weight_pushes"] == 3 and ranks[1]["weight_pushes"] == 0
    assert ranks[0]["weight_syncs"] == ranks[1]["weight_syncs"] == 3
