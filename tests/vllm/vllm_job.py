"""The project's training path with the real vLLM engine (CPU build), colocated.

Run by tests/vllm/test_vllm_engine.py in the venv of tests/vllm/make_venv.sh:

    PYTHONPATH=. $(bash tests/vllm/make_venv.sh) tests/vllm/vllm_job.py --out result.json --workdir DIR

A tiny Qwen2 (head_dim 64, as vLLM's CPU attention needs) is warm-started on the tiny env
so that its replies are valid and its rollouts differ (non-zero advantages: the loss runs),
saved, and trained for 2 steps with LoRA, `bipace_q` and `use_vllm=True,
vllm_mode="colocate"`, evaluated before and after at the eval temperature. Everything it
checks is written to the JSON for the test to assert on.
"""

from __future__ import annotations

from tests.vllm.job import job_arguments, write_result


def main() -> None:
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import pad

    from bipace_trainer.rollout.hidden import forward_hidden_states
    from bipace_trainer.rollout.vllm_backend import engine_logprobs
    from tests.trainer.tiny_setup import LORA, CapturingTrainer, lora_state, make_model, make_tokenizer, tiny_args, warm_start

    args, work = job_arguments()

    class EngineJobTrainer(CapturingTrainer):
        """Also records the sampling temperature of every generate call and, for every
        training rollout, the hidden states of an extra forward pass to compare with the
        ones captured during the old-logprob pass."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            generate = self.collector.generate_turn

            def recorded(messages, environments=None):
                self.temperatures.append(("train" if self.model.training else "eval", self.vllm_generation.temperature))
                return generate(messages, environments)

            self.collector.generate_turn = recorded

        def on_rollout(self, rollout, advantages, diagnostics):
            super().on_rollout(rollout, advantages, diagnostics)
            prompts = [torch.tensor(s.prompt_ids) for s in rollout.steps]
            ids = pad(prompts, padding_value=self._tokenizer.pad_token_id, padding_side="left")
            mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left")
            reference = forward_hidden_states(self.model, ids, mask, self.args.cluster_layer)
            captured = self._estimated_hidden  # the old-logprob pass's: the estimator ran just before the hook
            self.hidden_gaps.append(float((captured - reference).abs().max()))

    tokenizer = make_tokenizer()
    model = warm_start(make_model(tokenizer, heads=1, kv_heads=1), tokenizer, str(work / "sft"))
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model")

    config = tiny_args(
        work / "run",
        preset="bipace_q",
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=1024,
        temperature=1.0,
        max_steps=2,
    )
    trainer = EngineJobTrainer(model, args=config, processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    trainer.captured, trainer.temperatures, trainer.hidden_gaps = [], [], []
    initial = lora_state(trainer.model)

    # A fixed completion to score with the engine and the trainer, before and after training.
    probe_prompt = trainer._tokenize_prompts([[{"role": "user", "content": "Your task is to: reach the goal. You are at 0."}]])[0]
    probe_prompt = [list(probe_prompt[0])]
    probe_completion = [tokenizer("<think></think><action>right</action>", add_special_tokens=False)["input_ids"]]

    def trainer_logprobs() -> list[float]:
        ids = torch.tensor([probe_prompt[0] + probe_completion[0]])
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, torch.ones_like(ids), len(probe_completion[0]), batch_size=1
            )
        return logps[0].tolist()

    trainer.train()
    trainer.vllm_generation.sync_weights()  # the last step's weights
    engine_after = engine_logprobs(trainer.vllm_generation, probe_prompt, probe_completion)[0]
    trained = trainer_logprobs()

    # Two LoRA steps move the probe's log-probs by ~0.02 nats, the size of the CPU engine's own
    # noise, so they cannot tell whether the engine follows the weights. A large, known change
    # can: every lora_B gets a seeded random push (doubled until the trainer's log-probs move by
    # more than 2 nats); the engine must still score the old weights before the next sync and
    # the pushed ones after it.
    generator = torch.Generator().manual_seed(0)
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    pushes = [torch.randn(p.shape, generator=generator) for p in lora_b]
    scale, pushed = 0.25, trained
    with torch.no_grad():
        while max(abs(a - b) for a, b in zip(pushed, trained)) <= 2.0 and scale < 64:
            for p, push in zip(lora_b, pushes):
                p.add_(push * scale)
            pushed, scale = trainer_logprobs(), scale * 2
    engine_stale = engine_logprobs(trainer.vllm_generation, probe_prompt, probe_completion)[0]
    trainer.vllm_generation.sync_weights()
    engine_pushed = engine_logprobs(trainer.vllm_generation, probe_prompt, probe_completion)[0]

    # The correction switched off: the batch is what it was before the correction existed.
    trainer.vllm_importance_sampling_correction = False  # TRL's setting, read once into the trainer's batch spec
    trainer.batch_spec = trainer.trl_batch_spec(mask_cut_episodes=False)
    rows = trainer.train_dataset.select(range(2))
    inputs = [{"task_id": row["task_id"]} for row in rows for _ in range(config.num_generations)]
    uncorrected = trainer.generate_and_score(inputs)
    trainer.close_envs()

    final = lora_state(trainer.model)
    logs = trainer.state.log_history
    result = {
        "generations": [
            {
                "steps": len(rollout.steps),
                "nonzero_advantages": int((advantages != 0).sum()),
                "skip_update": skipped,
                "is_ratio_shape": (
                    list(batch["importance_sampling_ratio"].shape) if "importance_sampling_ratio" in batch else None
                ),
                "completion_shape": list(batch["completion_ids"].shape),
                "sampling_logprobs_per_step": all(
                    s.sampling_logprobs is not None and len(s.sampling_logprobs) == len(s.completion_ids) for s in rollout.steps
                ),
                "all_steps_have_hidden": hidden is not None and len(hidden) == len(rollout.steps),
            }
            for (rollout, advantages, batch), skipped, hidden in zip(trainer.captured, trainer.skipped_updates,
                                                                     trainer.captured_hidden)
        ],
        "hidden_gaps": trainer.hidden_gaps,
        "lora_changed": any(not torch.equal(initial[n], final[n]) for n in initial),
        "losses": [e["loss"] for e in logs if "loss" in e and "train_loss" not in e],
        "weight_syncs": [e["vllm/weight_syncs"] for e in logs if "vllm/weight_syncs" in e],
        "generate_calls": [e.get("time/generate_s") is not None for e in logs],
        "is_metrics": [{k: v for k, v in e.items() if k.startswith("sampling/")} for e in logs if "vllm/weight_syncs" in e],
        "prefix_cache": [
            {k: e[k] for k in ("rollout/prompt_tokens", "rollout/prompt_tokens_encoded", "rollout/prompt_tokens_reused",
                               "rollout/prefix_cache_hit_rate")}
            for e in logs if "vllm/weight_syncs" in e
        ],
        "probe": {
            "engine_after": engine_after, "trainer_after": trained,
            "trainer_pushed": pushed, "engine_stale": engine_stale, "engine_pushed": engine_pushed,
        },
        "temperatures": trainer.temperatures,
        "eval_temperature": config.eval_temperature,
        "train_temperature": config.temperature,
        "eval_history": [{k: e[k] for k in ("tag", "success_rate", "num_tasks")} for e in trainer.eval_history],
        "uncorrected_keys": sorted(k for k in uncorrected if isinstance(k, str)),
        "max_turns": config.max_turns,
    }
    write_result(args, result)


if __name__ == "__main__":  # vLLM spawns workers: the guard keeps them from re-running the job
    main()
