"""What meets TRL's loss: a played rollout made into TRL's batch, and TRL's update run over it.

    adapter         GRPOAdapter(GRPOTrainer): the one class that reads and writes GRPOTrainer's private
                    state, and hands it out as values and bound methods (the trainer's base class)
    policy          TRLPolicy: the rollout's `Policy` over TRL's own generation (TRLGeneration: what it takes)
    batching        a rollout's steps made into TRL's training batch (one row per env step), old and
                    reference log-probs, TRL's vLLM importance-sampling correction
    scoring         a played rollout scored: TRL's batch with the estimator's advantages, and its metrics
    overlap         the next generation played on a background thread while the update runs (max_staleness=1)
    one_step        GRPOTrainer's own advantage, for plain prompts (one-step episodes)
    metrics         GRPOTrainer's own metric names (reward, completions/*, tools/*, ...), per episode
    micro_batches   TRL's micro-batch split into pieces, their losses combined as TRL's
    shared_prefix   each shared token prefix forwarded once in TRL's log-prob passes
    packed_attention  the shared-prefix forward's attention without an N x N mask
    memory          bounds on a CPU process's resident memory and LM-head work

The only part of the package that touches TRL's, vLLM's or transformers' private names (besides the
ledger, `bipace_trainer.trl_compat`, which lists each one: tests/update/test_ledger.py).

May import: `bipace_trainer.rollout` (what a rollout is, the Policy interface), `bipace_trainer.advantages`,
`bipace_trainer.run` (the checkpoint files the adapter writes), `bipace_trainer.trl_compat`, TRL,
transformers, vLLM. Never `trainer`, `config`, `cli` or `reports`: the trainer drives the update.
"""
