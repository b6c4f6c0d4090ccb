"""studies.learning.study's command line: what --validation-only and --rl-steps change in the plans."""
from __future__ import annotations

from studies.learning import study
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
