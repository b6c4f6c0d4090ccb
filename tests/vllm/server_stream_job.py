"""The continuous rollout through a real vLLM server (`rollout.vllm_stream.ServerStream`).

Run by tests/vllm/test_vllm_server_stream.py in the venv of tests/vllm/make_venv.sh:

    PYTHONPATH=. $(bash tests/vllm/make_venv.sh) tests/vllm/server_stream_job.py --out result.json --workdir DIR

Starts vLLM's OpenAI-compatible server on the tiny Qwen2 of vllm_job.py (random weights: the
path is under test, not the policy's skill) as `trl vllm-serve` starts it (`bench.vllm_server`),
then trains 2 LoRA steps of `bipace_q` with `use_vllm=True, vllm_mode="server",
rollout_mode="continuous"`, at most 3 requests out at once (`rollout_batch_size`: episodes of
different turns then share the server), evaluated before and after, twice with one seed
against the same server. The one stand-in: TRL's weight transfer to a server is NCCL, which
needs CUDA, so the pushes are walked and counted, not sent
(`bench.vllm_server.without_weight_transfer`); the server keeps its initial weights. Every request the stream sends and every reply it
collects is logged with its wall time; everything the test checks is written to the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

from tests.vllm.job import job_arguments, write_result


def main() -> None:
    from peft import LoraConfig
    from transformers import set_seed

    from bench.vllm_server import serve, without_weight_transfer
    from bipace_trainer.rollout import vllm_stream
    from tests.trainer.tiny_setup import LORA, CapturingTrainer, make_model, make_tokenizer, tiny_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--server_url", help="an already running server on the job's model (development)")
    args, work = job_arguments(parser)
    work.mkdir(parents=True, exist_ok=True)

    tokenizer = make_tokenizer()
    if not (work / "model" / "config.json").exists():
        make_model(tokenizer, heads=1, kv_heads=1).save_pretrained(work / "model")
        tokenizer.save_pretrained(work / "model")

    # what the streams sent: (run, stream, wall time, key, seed); what they collected: (run,
    # stream, wall time, key). A stream is one rollout (evaluations included), numbered per run.
    sent, collected, run, streams = [], [], [0], []
    submit, step = vllm_stream.ServerStream.submit, vllm_stream.ServerStream.step

    def number(stream) -> int:
        if not any(stream is s for s in streams):
            streams.append(stream)
        return next(i for i, s in enumerate(streams) if s is stream)

    def logged_submit(self, key, prompt_ids, params):
        sent.append((run[0], number(self), time.monotonic(), list(key), params["seed"]))
        return submit(self, key, prompt_ids, params)

    def logged_step(self):
        finished = step(self)
        now = time.monotonic()
        collected.extend((run[0], number(self), now, list(f.key)) for f in finished)
        return finished

    vllm_stream.ServerStream.submit, vllm_stream.ServerStream.step = logged_submit, logged_step

    def train(url: str, index: int) -> dict:
        from transformers import AutoModelForCausalLM

        run[0] = index
        streams.clear()
        set_seed(0)
        model = AutoModelForCausalLM.from_pretrained(work / "model")
        config = tiny_args(work / f"run{index}", preset="bipace_q", use_vllm=True, vllm_mode="server",
                           vllm_server_base_url=url, vllm_server_timeout=60, temperature=1.0, max_steps=2,
                           rollout_mode="continuous", rollout_batch_size=3)
        trainer = CapturingTrainer(model, args=config, processing_class=tokenizer, peft_config=LoraConfig(**LORA))
        trainer.captured = []
        calls = []
        plain = trainer.collector.generate_turn
        trainer.collector.generate_turn = lambda *a, **k: calls.append(1) or plain(*a, **k)
        trainer.train()

        # TRL's own server-mode generate, its payload beside the stream's for the same settings
        generation, bodies = trainer.vllm_generation, []
        post = generation.vllm_client._post

        def capturing(url, **kwargs):
            bodies.append(kwargs.get("json"))
            return post(url, **kwargs)

        generation.vllm_client._post = capturing
        generation.generate(prompts=[[1, 2, 3]], images=None, num_generations=1)
        generation.vllm_client._post = post
        trl_body = {k: v for k, v in bodies[-1].items() if k not in ("prompt", "model")}
        ours = {"return_token_ids": True, "return_tokens_as_token_ids": True,
                **vllm_stream.server_sampling_params(generation, None)}
        trainer.close_envs()

        logs = trainer.state.log_history
        trained = [e for e in logs if "vllm/weight_syncs" in e]
        return {
            "streams_used": trainer.collector.streams,
            "generate_turn_calls": len(calls),
            "rollouts": [
                {
                    "engine_steps": rollout.engine_steps,
                    "steps": [
                        {"traj": s.traj, "t": s.t, "completion_ids": s.completion_ids, "prompt_ids": s.prompt_ids,
                         "logprobs": len(s.sampling_logprobs or []), "hidden": s.hidden is not None, "reply": s.reply}
                        for s in rollout.steps
                    ],
                    "episode_lengths": [e.length for e in rollout.episodes],
                    "episodes_failed": [e.failed for e in rollout.episodes],
                    "has_is_ratio": "importance_sampling_ratio" in batch,
                }
                for rollout, advantages, batch in trainer.captured
            ],
            "losses": [e["loss"] for e in logs if "loss" in e and "train_loss" not in e],
            "weight_syncs": [e["vllm/weight_syncs"] for e in trained],
            "metrics": [{k: v for k, v in e.items() if k.startswith(("rollout/", "sampling/"))} for e in trained],
            "eval_history": [{k: e[k] for k in ("tag", "num_tasks")} for e in trainer.eval_history],
            "payload": {"trl": trl_body, "stream": ours},
        }

    with (contextlib.nullcontext(args.server_url) if args.server_url
          else serve(work / "model", work / "server.log")) as url, without_weight_transfer() as pushes:
        runs = [train(url, 0), train(url, 1)]
    result = {"runs": runs, "sent": sent, "collected": collected, "pushes": pushes}
    write_result(args, result)


if __name__ == "__main__":
    sys.exit(main())
