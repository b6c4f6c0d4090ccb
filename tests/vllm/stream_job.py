"""The continuous rollout through vLLM colocate's own continuous batching (`rollout.vllm_stream`).

Run by tests/vllm/test_vllm_engine.py in the venv of tests/vllm/make_venv.sh, twice with the
same seed:

    PYTHONPATH=. $(bash tests/vllm/make_venv.sh) tests/vllm/stream_job.py --out result.json --workdir DIR

The tiny Qwen2 of vllm_job.py (warm-started on the tiny env; saved under DIR/model and
reused by a second run) trains 2 LoRA steps of `bipace_q` with `use_vllm=True,
vllm_mode="colocate", rollout_mode="continuous"`, evaluated before and after. Every request
that enters the engine is logged with the engine step it entered at; everything the test
checks is written to the JSON.
"""

from __future__ import annotations

import contextlib

from tests.vllm.job import job_arguments, write_result


def main() -> None:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, set_seed

    from bipace_trainer.rollout import vllm_stream
    from tests.trainer.tiny_setup import LORA, CapturingTrainer, make_model, make_tokenizer, tiny_args, warm_start

    args, work = job_arguments()

    tokenizer = make_tokenizer()
    if not (work / "model" / "config.json").exists():
        model = warm_start(make_model(tokenizer, heads=1, kv_heads=1), tokenizer, str(work / "sft"))
        model.save_pretrained(work / "model")
        tokenizer.save_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model")

    # what entered the engine: (rollout, engine steps run so far by this stream, key, seed), and
    # what left it: (rollout, the engine step it finished in, key)
    entered, left, streams = [], [], []
    submit, step = vllm_stream.EngineStream.submit, vllm_stream.EngineStream.step

    def logged_submit(self, key, prompt_ids, params):
        if not any(self is s for s in streams):
            streams.append(self)
            self.steps_run = 0
        entered.append((len(streams) - 1, self.steps_run, list(key), params.seed))
        return submit(self, key, prompt_ids, params)

    def counted_step(self):
        self.steps_run += 1
        finished = step(self)
        stream = next(i for i, s in enumerate(streams) if s is self)
        left.extend((stream, self.steps_run, list(f.key)) for f in finished)
        return finished

    vllm_stream.EngineStream.submit, vllm_stream.EngineStream.step = logged_submit, counted_step

    set_seed(0)  # the LoRA init must not depend on whether this run warm-started the model
    config = tiny_args(
        work / "run",
        preset="bipace_q",
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=1024,
        temperature=1.0,
        max_steps=2,
        rollout_mode="continuous",
    )
    trainer = CapturingTrainer(model, args=config, processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    trainer.captured = []
    generate_turn_calls = []
    plain = trainer.collector.generate_turn
    trainer.collector.generate_turn = lambda *a, **k: generate_turn_calls.append(1) or plain(*a, **k)
    trainer.train()

    # the stream's SamplingParams against the ones TRL's own colocate generate builds (at the
    # training temperature and at an evaluation's): the same but for the stream's seed
    generation, sampling = trainer.vllm_generation, []
    plain_generate = generation.llm.generate

    def capturing(prompts, sampling_params=None, **kwargs):
        sampling.append(sampling_params)
        return plain_generate(prompts, sampling_params=sampling_params, **kwargs)

    generation.llm.generate = capturing
    params = []
    for temperature in (None, 0.4):
        with trainer.collector.sampling_temperature(temperature) if temperature else contextlib.nullcontext():
            generation.generate(prompts=[[1, 2, 3]], images=None, num_generations=1)
            params.append({"trl": repr(sampling[-1]), "stream": repr(vllm_stream.colocate_sampling_params(generation, None))})
    generation.llm.generate = plain_generate
    trainer.close_envs()

    logs = trainer.state.log_history
    trained = [e for e in logs if "vllm/weight_syncs" in e]
    result = {
        "streams_used": trainer.collector.streams,
        "generate_turn_calls": len(generate_turn_calls),
        "entered": entered,
        "left": left,
        "rollouts": [
            {
                "engine_steps": rollout.engine_steps,
                "generate_calls": rollout.generate_calls,
                "steps": [
                    {"traj": s.traj, "t": s.t, "completion_ids": s.completion_ids, "prompt_ids": s.prompt_ids,
                     "logprobs": len(s.sampling_logprobs or []), "reply": s.reply}
                    for s in rollout.steps
                ],
                # the old-logprob pass's hidden states, one row per step, in the estimator's input
                "hidden_rows": None if hidden is None else len(hidden),
                "episode_lengths": [e.length for e in rollout.episodes],
                "episodes_failed": [e.failed for e in rollout.episodes],
                "nonzero_advantages": int((advantages != 0).sum()),
                "has_is_ratio": "importance_sampling_ratio" in batch,
                "batch_rows": int(batch["completion_ids"].shape[0]),
            }
            for (rollout, advantages, batch), hidden in zip(trainer.captured, trainer.captured_hidden)
        ],
        "losses": [e["loss"] for e in logs if "loss" in e and "train_loss" not in e],
        "weight_syncs": [e["vllm/weight_syncs"] for e in trained],
        "metrics": [{k: v for k, v in e.items() if k.startswith(("rollout/", "time/"))} for e in trained],
        "eval_history": [{k: e[k] for k in ("tag", "success_rate", "num_tasks")} for e in trainer.eval_history],
        "sampling_params": params,
        "max_turns": config.max_turns,
        "max_completion_length": config.max_completion_length,
    }
    write_result(args, result)


if __name__ == "__main__":  # vLLM spawns workers: the guard keeps them from re-running the job
    main()
