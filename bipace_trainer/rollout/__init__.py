"""Playing episodes, and what each played step becomes: everything between an env and TRL's batch.

    policy          the narrow interface the rollout generates through (ModelPolicy / VLLMPolicy: a plain
                    model, for bipace-eval; the trainer's TRL generation is `update.policy.TRLPolicy`)
    loop            run_rollouts: lockstep or continuous multi-turn rollouts → Rollout (docs/concepts/math.md#step-records)
    types           what a rollout is made of: RolloutSettings and EnvSpec (the values it is built from), Generation,
                    TaskRef, StepRecord, Episode, Rollout, Action
    adapters        kinds of environment as the loops play them: EnvAdapter, TextEnvAdapter
    lockstep        the lockstep loop; continuous: the continuous loops (calls, or an engine stream)
    play            what every loop shares: LoopState, the per-episode bookkeeping, prompt counts
    sync            the cross-rank reductions (LocalSync, CrossRankSync)
    collector       RolloutCollector: one way to play, training and evaluation alike, through a Policy
    tool_envs       TRL's environment_factory / tools played turn by turn (ToolEnvAdapter, ToolEnvSetup)
    vllm_backend    what the multi-turn rollout adds to TRL's vLLM generation
    vllm_stream     the continuous rollout through vLLM's own continuous batching (colocate, server)
    prefix_cache    HF generate that prefills only the prompt tokens whose KV is not known yet
    hidden          the actor's hidden state at one layer (BiGPO's φ(s)); HiddenPlan: where a run's come from
    prompting       the step's prompt (GiGPO's format); actions: reply → env action, validity, key
    trajectories    what the agent did, readable: step rows, the completions table, rollout dumps

May import: `bipace_trainer.advantages` (StepBatch, the estimate it records), `envs`, TRL,
transformers, and `bipace_trainer.trl_compat` (where what it changes inside TRL and vLLM lives).
Never `run/`, `reports/`, `cli/`, `trainer` or `config`: the trainer drives the rollout, never
the other way round. The rollout is handed a `Policy` and values (`RolloutSettings`, `EnvSpec`, `ToolEnvSetup`),
never the trainer or its config (tests/test_seam.py, tests/rollout/test_collector_values.py).
"""
