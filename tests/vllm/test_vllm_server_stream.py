"""Continuous rollouts through a real vLLM server (CPU build, its own venv): tests/vllm/server_stream_job.py
starts vLLM's OpenAI-compatible server as `trl vllm-serve` runs it and trains 2 LoRA steps twice
with one seed (~1.5-3 min with the server's start)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.vllm.test_vllm_engine import ENV, ROOT, venv_python  # noqa: F401  (the venv fixture)


def in_flight_together(sent, collected, stream, run=0) -> set[tuple[int, int]]:
    """Pairs of turns (t, u), t < u, of which a request each was out at the server at one moment."""
    out = {tuple(key): at for r, s, at, key, _ in sent if (r, s) == (run, stream)}
    back = {tuple(key): at for r, s, at, key in collected if (r, s) == (run, stream)}
    assert out.keys() == back.keys()  # every request came back
    return {(a[1], b[1]) for a in out for b in out
            if a[1] < b[1] and out[a] < back[b] and out[b] < back[a]}


@pytest.mark.slow
def test_continuous_rollouts_stream_through_a_vllm_server_and_repeat_under_a_seed(venv_python, tmp_path):  # noqa: F811
    out = tmp_path / "result.json"
    job = subprocess.run(
        [venv_python, str(ROOT / "tests" / "vllm" / "server_stream_job.py"), "--out", str(out), "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=1200, env=ENV, cwd=ROOT,
    )
    server_log = (tmp_path / "server.log").read_text()[-3000:] if (tmp_path / "server.log").exists() else ""
    assert job.returncode == 0, f"the server stream job failed:\n{job.stderr[-6000:]}\n--- server log:\n{server_log}"
    result = json.loads(out.read_text())
    first, second = result["runs"]
    # every rollout, training and evaluation, went through the server stream: no call at all
    assert first["streams_used"] and first["generate_turn_calls"] == 0
    assert first["weight_syncs"] == [1.0, 2.0]  # pushed once per step, as call by call
    assert result["pushes"] and all(walked > 0 for walked in result["pushes"])
    # a request carries TRL's own server payload (TRL's generate against the same server)
    assert first["payload"]["trl"] == first["payload"]["stream"]
    assert [e["tag"] for e in first["eval_history"]] == ["before", "final"]
    for rollout, metrics in zip(first["rollouts"], first["metrics"]):
        steps = rollout["steps"]
        # one record per env step, each with the server's logprob of every completion token
        assert len(steps) == sum(rollout["episode_lengths"]) > 0 and not any(rollout["episodes_failed"])
        assert all(s["completion_ids"] and s["logprobs"] == len(s["completion_ids"]) for s in steps)
        assert [(s["t"], s["traj"]) for s in steps] == sorted((s["t"], s["traj"]) for s in steps)  # lockstep's order
        assert rollout["has_is_ratio"]
        # the server's logprobs are the trainer's own for the same tokens (the weights did not
        # move: the CPU cannot push them, and no update ran on this untrained policy)
        assert metrics["sampling/sampling_logp_difference/max"] < 1e-4
        assert metrics["rollout/engine_steps"] == rollout["engine_steps"] > 0  # collection rounds
        # the server reported its prefix cache: a group's copies share their first prompt
        assert metrics["rollout/prompt_tokens_encoded"] + metrics["rollout/prompt_tokens_reused"] == metrics["rollout/prompt_tokens"]
        assert metrics["rollout/prompt_tokens_reused"] > 0
    # at most 3 requests out at once, and requests of different turns out at the server together
    training = sorted({s for run, s, *_ in result["sent"] if run == 0})[1:3]  # streams 0 and 3 are the evaluations
    for stream in training:
        assert in_flight_together(result["sent"], result["collected"], stream), stream
    # each request had its own seed; the same seed replayed the same requests (in the order
    # the replies' timing gave) and the same replies
    seeds = [seed for run, *_, seed in result["sent"] if run == 0]
    assert len(set(seeds)) == len(seeds)
    requests = [sorted((s, k, seed) for r, s, _, k, seed in result["sent"] if r == run) for run in (0, 1)]
    assert requests[0] == requests[1]
    for a, b in zip(first["rollouts"], second["rollouts"]):
        assert a["steps"] == b["steps"]
    assert second["losses"] == pytest.approx(first["losses"])
