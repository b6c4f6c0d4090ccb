"""Our envs over HTTP/WebSocket: OpenEnv's real server on localhost, its client, faults, and GRPOTrainer on top.

Every test here starts a server process (`envs.openenv_server.LocalServer`, whose PID the
fixture owns and stops), so all are slow. Faults strike chosen task ids only (`Fault`), so a
test knows which episodes a fault touches and checks that the others are untouched.
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("openenv.core", reason="pip install -e '.[openenv]'")

from envs import EnvironmentFailure  # noqa: E402
from envs.openenv_env import openenv_trl_environment  # noqa: E402
from envs.openenv_server import Fault, LocalServer, free_port, refused_url  # noqa: E402
from envs.tiny import TinyEnv  # noqa: E402

pytestmark = pytest.mark.slow

TINY = {"size": 4}
GARBLED, SLOW, ERROR = 1, 2, 4  # task ids the shared server misbehaves on, at their first step
HEALTHY = 0
CLIENT_TIMEOUT = 1.0
NEVER_HANGS = 60.0  # generous bound on any one call: far above every timeout in play, far below a hang


@pytest.fixture(scope="module")
def server():
    faults = [
        Fault("garble", frozenset({GARBLED})),
        Fault("slow", frozenset({SLOW}), seconds=20 * CLIENT_TIMEOUT),
        Fault("error", frozenset({ERROR})),
    ]
    with LocalServer("tiny", TINY, faults=faults) as running:
        yield running


def bounded(call):
    """Runs `call()` in a thread; returns (result or exception); fails the test if it never returns."""
    outcome = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            outcome["value"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(NEVER_HANGS)
    assert not thread.is_alive(), f"the call did not return within {NEVER_HANGS:g} s"
    return outcome["value"]


def test_a_served_episode_matches_the_local_env(server):
    Served = openenv_trl_environment(server.url, timeout_s=10)
    tool, env = Served(), TinyEnv(**TINY)
    first = tool.reset(task_id=HEALTHY, prompt="row columns are ignored")
    truth = env.reset(HEALTHY)
    assert first.startswith(TinyEnv.instruction) and truth.observation in first and tool.anchor == truth.anchor
    text = tool.act("right")
    truth = env.step("right")
    assert text.split("\n")[0] == truth.observation
    assert (tool.done, tool.won, tool.get_reward(), tool.failure) == (True, True, 1.0, None)
    assert tool.act("right").startswith("The episode is over; nothing was done.")


def test_sessions_are_isolated(server):
    Served = openenv_trl_environment(server.url, timeout_s=10)
    first, second = Served(), Served()
    first.reset(task_id=9)  # start 3, goal 0
    second.reset(task_id=HEALTHY)  # start 0, goal 1
    second.act("right")
    assert second.won and not first.done
    first.act("left")
    assert first.anchor.startswith("You are at cell 2.")


@pytest.mark.parametrize(
    ("task_id", "kind"),
    [(GARBLED, "bad_result"), (SLOW, "timeout"), (ERROR, "server_error")],
)
def test_a_faulty_answer_ends_only_its_episode_within_the_timeout(server, task_id, kind):
    Served = openenv_trl_environment(server.url, timeout_s=CLIENT_TIMEOUT, close_timeout_s=CLIENT_TIMEOUT)
    tool, bystander = Served(), Served()
    bystander.reset(task_id=9)
    tool.reset(task_id=task_id)
    error = bounded(lambda: tool.act("right"))
    assert isinstance(error, EnvironmentFailure) and "this episode is over" in str(error)
    assert tool.failure.startswith(kind) and server.url in tool.failure
    assert tool.done and not tool.won and tool.get_reward() == 0.0
    assert bystander.act("left").startswith("You moved left.")  # the other session is untouched
    tool.reset(task_id=HEALTHY)  # the same instance reconnects for its next episode
    tool.act("right")
    assert tool.won and tool.failure is None


def test_a_refused_connection_fails_the_episode_at_reset():
    tool = openenv_trl_environment(refused_url(), connect_timeout_s=CLIENT_TIMEOUT)()
    error = bounded(lambda: tool.reset(task_id=HEALTHY))  # raised at reset, as a local env that cannot start
    assert isinstance(error, EnvironmentFailure) and error.kind == "unreachable"
    assert tool.failure.startswith("unreachable") and tool.done
    with pytest.raises(EnvironmentFailure, match="unreachable") as raised:
        tool.act("right")
    assert raised.value.kind == "unreachable"


def test_a_server_killed_mid_episode_fails_its_open_episodes_and_later_resets():
    with LocalServer("tiny", TINY) as server:
        Served = openenv_trl_environment(server.url, timeout_s=10, close_timeout_s=CLIENT_TIMEOUT)
        playing, finished = Served(), Served()
        playing.reset(task_id=9)
        playing.act("left")
        finished.reset(task_id=HEALTHY)
        finished.act("right")
        server.kill()
        assert server.process.poll() is not None
        error = bounded(lambda: playing.act("left"))
        assert isinstance(error, EnvironmentFailure) and playing.failure.startswith("connection_lost")
        assert finished.won and finished.get_reward() == 1.0  # an episode that ended before keeps its result
        error = bounded(lambda: finished.reset(task_id=HEALTHY))
        assert isinstance(error, EnvironmentFailure) and finished.failure.startswith("unreachable")


def test_a_server_that_kills_itself_mid_episode_is_a_lost_connection():
    with LocalServer("tiny", TINY, faults=[Fault("die", frozenset({9}), at_step=2)]) as server:
        tool = openenv_trl_environment(server.url, timeout_s=10, close_timeout_s=CLIENT_TIMEOUT)()
        tool.reset(task_id=9)
        tool.act("left")
        error = bounded(lambda: tool.act("left"))
        assert isinstance(error, EnvironmentFailure) and tool.failure.startswith("connection_lost")
        server.process.wait(timeout=30)
        assert server.process.returncode != 0


def test_fault_specs_round_trip_and_bad_ones_name_the_field():
    fault = Fault("slow", frozenset({3, 1}), at_step=2, seconds=7.5)
    assert Fault.parse(fault.to_arg()) == fault
    assert Fault.parse("die") == Fault("die")
    with pytest.raises(ValueError, match="kind='melt'"):
        Fault("melt")
    with pytest.raises(ValueError, match="unknown field 'when'"):
        Fault.parse("die:when=3")
    with pytest.raises(ValueError, match="base_url"):
        openenv_trl_environment(f"127.0.0.1:{free_port()}")


def test_grpo_trainer_trains_two_steps_through_the_openenv_server(server, tool_policy, tmp_path):
    from trl import GRPOTrainer

    from envs import trl_task_dataset
    from tests.trl.test_grpo_trainer import Outcomes, grpo_args, trained

    model, tokenizer = tool_policy
    dataset = trl_task_dataset("tiny", **TINY).filter(lambda row: row["task_id"] not in (GARBLED, SLOW, ERROR))
    outcomes = Outcomes()
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=grpo_args(tmp_path, reward_weights=[0.0]),
                          train_dataset=dataset, reward_funcs=outcomes,
                          environment_factory=openenv_trl_environment(server.url, timeout_s=10))
    logs = trained(trainer)
    assert trainer.state.global_step == 2 and len(outcomes.seen) == 8
    assert max(logs["tools/call_frequency"]) > 0 and "rewards/OpenEnvTextEnvironment/mean" in logs
    assert any(seen["steps"] > 0 for seen in outcomes.seen)  # episodes were played on the server
    assert all(seen["failure"] is None for seen in outcomes.seen)


def test_grpo_trainer_survives_a_misbehaving_server(server, tool_policy, tmp_path):
    """Faulty tasks are in the dataset: their rollouts fail (and only theirs), the run goes on."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from envs.trl_env import TASK_PROMPT
    from tests.trl.test_grpo_trainer import Outcomes, grpo_args, trained

    model, tokenizer = tool_policy
    Served = openenv_trl_environment(server.url, timeout_s=CLIENT_TIMEOUT, close_timeout_s=CLIENT_TIMEOUT)
    task_ids = [GARBLED, ERROR, SLOW, HEALTHY]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": TASK_PROMPT}], "task_id": t} for t in task_ids])
    outcomes = Outcomes()
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=outcomes, train_dataset=dataset,
                          args=grpo_args(tmp_path, per_device_train_batch_size=8), environment_factory=Served)
    logs = trained(trainer)
    seen = [(s["task_id"], s["failure"]) for s in outcomes.seen]
    assert trainer.state.global_step == 2 and len(seen) == 16
    assert {task_id for task_id, _ in seen} == set(task_ids)  # every task was played
    failed = {task_id for task_id, failure in seen if failure}
    assert failed and failed <= {GARBLED, ERROR, SLOW}  # only the faulty tasks' episodes failed
    assert all(failure is None for task_id, failure in seen if task_id == HEALTHY)
    assert max(logs["tools/failure_frequency"]) > 0


def test_bipace_trainer_survives_a_misbehaving_server(server, tool_policy, tmp_path):
    """Under BiPACETrainer each fault ends only the episodes it touches, counted in env/failures."""
    from datasets import Dataset

    from envs.trl_env import TASK_PROMPT
    from tests.trainer.test_trl_environment import Recording
    from tests.trl.test_bipace_trainer import bipace_args

    model, tokenizer = tool_policy
    Served = openenv_trl_environment(server.url, timeout_s=CLIENT_TIMEOUT, close_timeout_s=CLIENT_TIMEOUT)
    task_ids = [GARBLED, ERROR, SLOW, HEALTHY]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": TASK_PROMPT}], "task_id": t} for t in task_ids])
    trainer = Recording(model=model, processing_class=tokenizer, train_dataset=dataset, environment_factory=Served,
                        args=bipace_args(tmp_path, tasks_per_iteration=4, num_generations=4))
    trainer.recorded = []
    trainer.train()
    trainer.close_envs()
    assert trainer.state.global_step == 1
    rollout, _ = trainer.recorded[0]
    assert {episode.task_id for episode in rollout.episodes} == set(task_ids)
    # Failures the server caused name it (a malformed tool call from the model is a failure too, of its own).
    by_server = [episode for episode in rollout.episodes if episode.failed and server.url in episode.failure]
    assert by_server and {episode.task_id for episode in by_server} <= {GARBLED, ERROR, SLOW}
    kinds = {GARBLED: "bad_result", ERROR: "server_error", SLOW: "timeout"}
    for episode in by_server:
        assert f"({kinds[episode.task_id]}: step at {server.url}" in episode.failure
    logged = max(entry.get("env/failures", 0) for entry in trainer.state.log_history)
    assert logged >= len(by_server)


def test_bipace_trainer_plays_a_reachable_server_beside_an_unreachable_one(server, tool_policy, tmp_path):
    """A dict factory: rows of "up" play the live server (a task it does not fault), rows of "down" a port
    nobody listens on. The run trains; every "down" episode fails at its reset as "unreachable", before the
    model's first turn (whether or not it would have called `act`), scores 0 and is counted in env/failures."""
    from envs import trl_task_dataset
    from tests.trainer.test_trl_environment import Recording
    from tests.trl.test_bipace_trainer import bipace_args

    model, tokenizer = tool_policy
    down = refused_url()
    factories = {
        "up": openenv_trl_environment(server.url, timeout_s=10),
        "down": openenv_trl_environment(down, connect_timeout_s=CLIENT_TIMEOUT),
    }
    healthy = 5  # cell 1 to 3; not one of the shared server's faulty tasks
    dataset = trl_task_dataset("tiny", **TINY).filter(lambda row: row["task_id"] == healthy)
    dataset = dataset.select([0] * 6).add_column("environment", ["up", "down"] * 3)  # no shuffle: "up", "down" first
    trainer = Recording(model=model, processing_class=tokenizer, train_dataset=dataset, environment_factory=factories,
                        args=bipace_args(tmp_path))
    trainer.recorded = []
    trainer.train()
    trainer.close_envs()
    assert trainer.state.global_step == 1
    rollout, _ = trainer.recorded[0]
    by_side = {side: [e for e in rollout.episodes if e.attributes.get("environment") == side] for side in factories}
    assert len(by_side["up"]) == len(by_side["down"]) == 8
    assert not any(e.failed and server.url in e.failure for e in by_side["up"])
    assert all(e.reward == 0.0 and not e.won for e in by_side["down"])
    failed_down = [e for e in by_side["down"] if e.failed]
    assert len(failed_down) == 8 and all(e.length == 0 for e in failed_down)
    assert all(f"unreachable: reset at {down}" in e.failure for e in failed_down)
    # the failure keeps its kind in the metrics (it was "exception" before)
    assert max(entry.get("env/failures/unreachable", 0) for entry in trainer.state.log_history) >= 8
    assert not any("env/failures/exception" in entry for entry in trainer.state.log_history)
    logged = max(entry.get("env/failures", 0) for entry in trainer.state.log_history)
    assert logged >= len(failed_down)


def test_grpo_trainer_stops_at_the_first_reset_when_nothing_listens(tool_policy, tmp_path):
    """Under GRPOTrainer a dead server must not train silently on episodes that never played: reset
    raises, as a local env that cannot start would, and TRL stops the run there."""
    from trl import GRPOTrainer

    from envs import trl_task_dataset
    from tests.trl.test_grpo_trainer import grpo_args

    model, tokenizer = tool_policy
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=grpo_args(tmp_path),
                          train_dataset=trl_task_dataset("tiny", **TINY),
                          environment_factory=openenv_trl_environment(refused_url(), connect_timeout_s=CLIENT_TIMEOUT))
    with pytest.raises(EnvironmentFailure, match="unreachable") as raised:
        trainer.train()
    assert raised.value.kind == "unreachable" and trainer.state.global_step == 0
