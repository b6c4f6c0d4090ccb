"""vLLM server mode on 2 processes, through TRL's own gather/broadcast/slice code, or with
`--rollout_mode continuous` through the server stream (`vllm_stream.ServerStream`: each rank
sends its own requests).

Run by tests/vllm/test_vllm_backend.py under `accelerate launch` (2 CPU processes, gloo).
The trainer's generation goes through TRL's real `VLLMGeneration.generate(mode="server")`
and `sync_weights`; only the HTTP client to `trl vllm-serve` is stood in for by
`EchoServer`, which answers each prompt with its own last 3 tokens (so a completion that
reaches the wrong prompt is seen) and a fixed sampling logprob, and counts weight pushes.
As in tests/trainer/dist_job.py, rank 0's episodes end after one turn, so the ranks send
different numbers of prompts in the same generate call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402

from bipace_trainer.rollout.hidden import HiddenPlan  # noqa: E402
from bipace_trainer.rollout.vllm_backend import PrefixCacheCounter, WeightSyncs  # noqa: E402
from tests.trainer.dist_job import RankSkewEnv  # noqa: E402,F401  (the env, by dotted path below)
from tests.trainer.tiny_setup import CapturingTrainer, make_model, make_tokenizer, tiny_args  # noqa: E402

SAMPLING_LOGPROB = -0.5


class EchoServer:
    """What `VLLMClient` returns, without a server: completion = the prompt's last 3 tokens + EOS.
    `generate` is TRL's call-by-call client; `_post` to /v1/completions what the continuous
    rollout's `ServerStream` sends per request (one prompt), answered in vLLM's format."""

    base_url, model = "http://echo", "echo"

    def __init__(self, eos: int):
        self.eos = eos
        self.weight_pushes = 0
        self.prompts_per_call: list[int] = []
        self.requests = 0
        self.lock = threading.Lock()

    def _post(self, url, json):
        assert url == f"{self.base_url}/v1/completions" and len(json["prompt"]) == 1 and json["n"] == 1, json
        with self.lock:
            self.requests += 1
        prompt = json["prompt"][0]
        completion = list(prompt[-3:]) + [self.eos]
        logprobs = {"tokens": [f"token_id:{t}" for t in completion], "token_logprobs": [SAMPLING_LOGPROB] * 4,
                    "top_logprobs": [{f"token_id:{t}": SAMPLING_LOGPROB} for t in completion]}
        return {"choices": [{"index": 0, "token_ids": completion, "prompt_token_ids": prompt, "logprobs": logprobs}]}

    def generate(self, prompts, n=1, **kwargs):
        self.prompts_per_call.append(len(prompts))
        completions = [list(p[-3:]) + [self.eos] for p in prompts for _ in range(n)]
        return {
            "prompt_ids": prompts,
            "completion_ids": completions,
            "logprobs": [[[SAMPLING_LOGPROB] for _ in c] for c in completions],
            "logprob_token_ids": [[[t] for t in c] for c in completions],
        }

    def update_named_params(self, metadata, params):
        for _ in params:
            pass
        self.weight_pushes += 1

    def reset_prefix_cache(self):
        pass


class ServerModeTrainer(CapturingTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        generate = self.collector.generate_turn

        def counted(messages, environments=None):
            self.prompt_counts.append(len(messages))
            return generate(messages, environments)

        self.collector.generate_turn = counted


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rollout_mode", default="lockstep")
    cli = parser.parse_args()
    tokenizer = make_tokenizer()
    args = tiny_args(
        cli.out,
        env_name="tests.trainer.dist_job:RankSkewEnv",
        env_kwargs={},
        preset="gigpo",
        num_generations=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_completion_length=8,
        eval_tasks=2,
        evaluate_before_training=False,
        shuffle_dataset=False,
        rollout_mode=cli.rollout_mode,
        vllm_mode="server",
    )
    trainer = ServerModeTrainer(make_model(tokenizer, seed=0), args=args, processing_class=tokenizer)
    trainer.captured, trainer.prompt_counts = [], []
    # What GRPOTrainer.__init__ sets up for use_vllm=True, vllm_mode="server", minus the HTTP client.
    with mock.patch.object(VLLMGeneration, "_init_vllm", lambda self: None):
        generation = VLLMGeneration(
            model=trainer.model, accelerator=trainer.accelerator, processing_class=tokenizer, mode="server",
            max_completion_length=args.max_completion_length, logprobs=0,
        )
    server = EchoServer(tokenizer.eos_token_id)
    continuous = cli.rollout_mode == "continuous"
    if trainer.accelerator.is_main_process or continuous:  # streaming, every rank sends its own requests
        generation.vllm_client = server
    trainer.use_vllm, trainer.vllm_generation, trainer._last_loaded_step = True, generation, -1
    # what the trainer's policy sets up for vLLM (`TRLPolicy`), on the policy built without it
    policy = trainer.policy
    policy.trl.vllm_generation, policy.use_vllm, trainer.batch_spec.use_vllm = generation, True, True
    policy.weight_syncs = WeightSyncs(generation)
    # the HiddenPlan chosen again, now under vLLM
    trainer.hidden_plan = trainer.collector.hidden = HiddenPlan.choose(
        trainer.needs_hidden, trainer.args.hidden_capture, True, trainer.args.cluster_layer)
    if continuous:  # what the policy sets up for vllm_mode="server" in continuous mode
        policy.can_stream, policy.prefix_cache = True, PrefixCacheCounter()
        assert trainer.collector.streams
    trainer.train()
    trainer.close_envs()

    rank = trainer.accelerator.process_index
    mismatches = sum(
        list(step.completion_ids[:3]) != list(step.prompt_ids[-3:]) or step.sampling_logprobs != [SAMPLING_LOGPROB] * 4
        for rollout, _, _ in trainer.captured
        for step in rollout.steps
    )
    result = {
        "rank": rank,
        "steps_checked": sum(len(rollout.steps) for rollout, _, _ in trainer.captured),
        "mismatches": mismatches,
        "prompt_counts": trainer.prompt_counts,
        "server_prompts_per_call": server.prompts_per_call,
        "requests": server.requests,
        "streamed": trainer.collector.streams,
        "weight_pushes": server.weight_pushes,
        "weight_syncs": trainer.policy.weight_syncs.count,
        "global_step": trainer.state.global_step,
        "is_ratio": [list(batch["importance_sampling_ratio"].shape) for _, _, batch in trainer.captured],
        "final_eval": trainer.eval_history[-1]["num_tasks"] if trainer.eval_history else None,
    }
    Path(cli.out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)


if __name__ == "__main__":
    main()
