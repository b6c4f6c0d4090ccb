"""Playing episodes, and what each played step becomes: everything between an env and TRL's batch.

    loop            run_rollouts: lockstep or continuous multi-turn rollouts → Rollout (StepRecord, Episode), TaskRef,
                    EnvAdapter / TextEnvAdapter (docs/concepts/math.md#step-records)
    collector       RolloutCollector: the trainer's one way to play, training and evaluation alike
    tool_envs       TRL's environment_factory / tools played turn by turn (ToolEnvAdapter)
    vllm_backend    what the multi-turn rollout adds to TRL's vLLM generation
    vllm_stream     the continuous rollout through vLLM's own continuous batching (colocate, server)
    prefix_cache    HF generate that prefills only the prompt tokens whose KV is not known yet
    hidden          the actor's hidden state at one layer (BiGPO's φ(s)), by hook or prefill
    prompting       the step's prompt (GiGPO's format); actions: reply → env action, validity, key
    batching        a rollout's steps made into TRL's training batch (one row per env step)
    overlap         the next generation played on a background thread while the update runs (max_staleness=1)
    trajectories    what the agent did, readable: step rows, the completions table, rollout dumps

May import: `bipace_trainer.advantages` (StepBatch, the estimate it records), `envs`, TRL,
transformers, and `bipace_trainer.trl_compat` (where what it changes inside TRL and vLLM lives).
Never `run/`, `reports/`, `cli/`, `trainer` or `config`: the trainer drives the rollout, never
the other way round (the collector takes TRL's `GRPOTrainer` for generation).
"""
