"""studies.learning: what --validation-only and --rl-steps change in the plans; a run a SIGTERM cut short is not recorded."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from bipace_trainer.run.callbacks import TrainingInterrupted
from studies.learning import study
from studies.learning.runner import refuse_interrupted
from studies.learning.plan import SIZES


def test_validation_only_keeps_the_validation_split_and_every_other_setting():
    args = study.parse_args(["--size", "cpu-textcraft", "--rl-steps", "10", "--validation-only"])
    plan = study.resolve_size(args).envs["textcraft"]
    full = SIZES["cpu-textcraft"].envs["textcraft"]
    assert full.eval_splits == ("valid", "test_ood", "train")
    assert plan.eval_splits == ("valid",)
    assert plan.rl_steps == 10
    assert plan.eval_interval == full.eval_interval and plan.eval_tasks == full.eval_tasks


def test_without_it_the_size_plans_evaluate_every_split():
    plan = study.resolve_size(study.parse_args(["--size", "cpu-textcraft"])).envs["textcraft"]
    assert plan == SIZES["cpu-textcraft"].envs["textcraft"]


def test_a_run_stopped_by_sigterm_is_not_recorded():
    state = SimpleNamespace(global_step=6, max_steps=30)
    refuse_interrupted(SimpleNamespace(interrupted=False, state=state), "gigpo seed 0")
    with pytest.raises(TrainingInterrupted, match="gigpo seed 0: a SIGTERM stopped it at step 6 of 30"):
        refuse_interrupted(SimpleNamespace(interrupted=True, state=state), "gigpo seed 0")
