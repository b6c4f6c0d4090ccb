"""Reading what a run wrote: the HTML report, a dump in the terminal, the end-of-run summary, the model card.

    report          one self-contained HTML page per run (bipace-report)
    show            a rollout dump in the terminal, episode by episode (python -m bipace_trainer.reports.show)
    run_summary     success with its Wilson interval, the valid-action rate, the learning curve
    model_card      the model card written next to the weights and pushed to the Hub

May import: `models` (the cache directory) and nothing else of the package: these read files
(trainer_state.json, rollout dumps, eval_history) and plain values, so they work on any run's
output directory without a trainer, a model or an env. Never `rollout/`, `run/`, `trainer`, `cli/`.
"""
