"""TRL's `environment_factory` path with the real vLLM engine (CPU build), colocated.

Run by tests/vllm/test_vllm_engine.py in the venv of tests/vllm/make_venv.sh:

    PYTHONPATH=. $(bash tests/vllm/make_venv.sh) tests/vllm/tool_job.py --out result.json --workdir DIR

The tool-calling tiny policy of tests/trl/tool_model.py, warm-started here with one head of
width 64 (vLLM's CPU attention needs head_dim >= 32), saved, reloaded and trained for 2 steps
(a generation each) of `BiPACETrainer` (`gigpo`) with `environment_factory=as_trl_environment("tiny")`, a user
reward function, rollout dumps, `use_vllm=True, vllm_mode="colocate"`, and evaluations
before and after. Counts the engine's and transformers' generate calls; writes everything
the test asserts on to the JSON.
"""

from __future__ import annotations

import json
import time

from tests.vllm.job import job_arguments, write_result


def main() -> None:
    import transformers
    import vllm
    from transformers import AutoModelForCausalLM

    from bipace_trainer import BiPACEConfig, BiPACETrainer
    from envs import as_trl_environment, trl_task_dataset
    from tests.trl.tool_model import TINY_KWARGS, make_tool_tokenizer, warm_start

    args, work = job_arguments()

    counts = {"engine_calls": 0, "hf_generate_calls": 0}

    def counted(cls, name, key):
        original = getattr(cls, name)

        def wrapper(self, *a, **k):
            counts[key] += 1
            return original(self, *a, **k)

        setattr(cls, name, wrapper)

    counted(vllm.LLM, "generate", "engine_calls")
    counted(vllm.LLM, "chat", "engine_calls")
    counted(transformers.GenerationMixin, "generate", "hf_generate_calls")

    start = time.perf_counter()
    tokenizer = make_tool_tokenizer()
    model = warm_start(tokenizer, heads=1, kv_heads=1)
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model")
    warm_seconds = time.perf_counter() - start

    class Recording(BiPACETrainer):
        rollouts: list = []

        def on_rollout(self, rollout, advantages, diagnostics):
            self.rollouts.append({
                "steps": [
                    {"t": s.t, "action": s.action, "valid": s.valid, "completion_tokens": len(s.completion_ids),
                     "logprobs": None if s.sampling_logprobs is None else len(s.sampling_logprobs)}
                    for s in rollout.steps
                ],
                "failed": sum(e.failed for e in rollout.episodes),
                "nonzero_advantages": int((advantages != 0).sum()),
            })  # fmt: skip

    def brevity(completions, **kwargs):  # a user reward function, as TRL passes it
        return [-0.01 * len(str(c)) for c in completions]

    data = trl_task_dataset("tiny", **TINY_KWARGS)
    config = BiPACEConfig(
        output_dir=str(work / "run"), preset="gigpo", max_steps=2, tasks_per_iteration=2, num_generations=2,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_turns=3, max_turn_length=48, max_completion_length=1024,
        max_tool_calling_iterations=3, learning_rate=1e-3, temperature=1.0, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, seed=0, disable_tqdm=True, eval_tasks=2, rollout_dump_steps=1, use_vllm=True, vllm_mode="colocate",
        vllm_max_model_length=2048,
    )  # fmt: skip
    trainer = Recording(
        model=model, args=config, processing_class=tokenizer, train_dataset=data.select(range(6)),
        eval_dataset=data.select(range(6, 8)), environment_factory=as_trl_environment("tiny", **TINY_KWARGS),
        reward_funcs=brevity,
    )  # fmt: skip
    train_start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - train_start
    trainer.close_envs()

    logs = trainer.state.log_history
    dumps = {f.name: [json.loads(line) for line in f.read_text().splitlines()]
             for f in sorted((work / "run" / "rollouts").glob("*.jsonl"))}  # fmt: skip
    result = {
        "global_step": trainer.state.global_step,
        "rollouts": Recording.rollouts,
        "losses": [e["loss"] for e in logs if "loss" in e and "train_loss" not in e],
        "weight_syncs": [e["vllm/weight_syncs"] for e in logs if "vllm/weight_syncs" in e],
        "is_ratio_mean": [e["sampling/importance_sampling_ratio/mean"] for e in logs
                          if "sampling/importance_sampling_ratio/mean" in e],  # fmt: skip
        "eval_history": [{k: e[k] for k in ("tag", "num_tasks")} for e in trainer.eval_history],
        "dumps": {name: [{"turns": [{"action": t["action"], "reply": t["reply"]} for t in e["turns"]]}
                         for e in episodes] for name, episodes in dumps.items()},  # fmt: skip
        "counts": counts,
        "warm_seconds": warm_seconds,
        "train_seconds": train_seconds,
    }
    write_result(args, result)


if __name__ == "__main__":  # vLLM spawns workers: the guard keeps them from re-running the job
    main()
