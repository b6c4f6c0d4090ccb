"""The continuous rollout through a streaming generator (`loop._continuous_stream`): vLLM
colocate's engine-level continuous batching, here with a stand-in engine that decodes one
token of every running request per step. What it checks is the loop's bookkeeping: when a
prompt enters the engine, when an env step is joined, that a seed repeats a run whatever the
env thread does, that failures end episodes and not the run. The real engine is tested in
tests/vllm/ (slow)."""

from __future__ import annotations

import random
import time

import pytest

from bipace_trainer.rollout.loop import (
    Generation,
    InlineEnvRunner,
    RolloutSettings,
    StreamingGenerator,
    TaskRef,
    TextEnvAdapter,
    ThreadEnvRunner,
    run_rollouts,
)
from envs.tiny import TinyEnv
from envs.vector import VectorEnv


def walk(messages):
    """The tiny env's optimal move, read from the observation."""
    return "<action>left</action>" if "to your left" in messages[-1]["content"] else "<action>right</action>"


class FakeStream:
    """A `StreamingGenerator`: request (traj, turn) needs `length(key)` engine steps, one token
    each; at most `max_seqs` requests decode per step (the rest wait, first come first
    served, as vLLM's scheduler); a reply is `reply(key, messages)`. `log` holds, per
    submit, (engine steps run so far, keys); `running` the requests in the engine per step."""

    def __init__(self, reply=lambda key, messages: walk(messages), length=lambda key: 1, max_seqs=None):
        self.reply, self.length, self.max_seqs = reply, length, max_seqs
        self.queue = []  # [key, prompt ids, text, steps left]
        self.steps = 0
        self.log, self.running, self.aborted = [], [], False

    def submit(self, keys, messages, environments=None):
        prompts = [[len(m[-1]["content"]), len(m)] for m in messages]
        self.log.append((self.steps, list(keys)))
        for key, m, ids in zip(keys, messages, prompts):
            self.queue.append([key, ids, self.reply(key, m), self.length(key)])
        return prompts

    def step(self):
        self.steps += 1
        self.running.append(len(self.queue))
        decoding = self.queue[: self.max_seqs] if self.max_seqs else list(self.queue)
        done = []
        for request in decoding:
            request[3] -= 1
            if request[3] <= 0:
                done.append(request)
        self.queue = [r for r in self.queue if r not in done]
        keys = [r[0] for r in done]
        return keys, Generation([r[1] for r in done], [[len(r[2])] for r in done], [r[2] for r in done],
                                logprobs=[[-0.5] for _ in done])

    def abort(self):
        self.aborted = True
        self.queue.clear()


def tasks(n, group_size=2):
    return [TaskRef(i % 12, group=i // group_size) for i in range(n)]


def test_the_stream_plays_the_same_steps_and_episodes_as_lockstep():
    def policy(messages, environments=None):
        return Generation([[len(m[-1]["content"]), len(m)] for m in messages], [[len(walk(m))] for m in messages],
                          [walk(m) for m in messages], logprobs=[[-0.5]] * len(messages))

    stream = FakeStream(length=lambda key: 1 + key[0] % 3)  # replies of 1-3 steps: episodes drift apart
    assert isinstance(stream, StreamingGenerator) and not isinstance(policy, StreamingGenerator)
    played = {}
    for name, generate, mode in (("lockstep", policy, "lockstep"), ("stream", stream, "continuous")):
        with VectorEnv("tiny", 9, backend="thread", num_workers=3) as envs:
            played[name] = run_rollouts(envs, tasks(9, 3), generate, RolloutSettings(max_turns=4, mode=mode))
    lock, cont = played["lockstep"], played["stream"]
    fields = lambda s: (s.group, s.traj, s.t, s.prompt_ids, s.completion_ids, s.reply, s.action, s.valid, s.anchor,
                        s.reward, s.observation, s.sampling_logprobs)
    assert [fields(s) for s in lock.steps] == [fields(s) for s in cont.steps]  # lockstep's order: turn, then env
    assert [vars(e) for e in lock.episodes] == [vars(e) for e in cont.episodes]
    assert any(e.won for e in cont.episodes) and len({e.length for e in cont.episodes}) > 1
    # generate_calls counts engine steps; the metric says the engine's own batching played it
    assert cont.generate_calls == cont.engine_steps == stream.steps > 0 and lock.engine_steps == 0
    assert cont.metrics()["rollout/engine_steps"] == stream.steps and "rollout/engine_steps" not in lock.metrics()
    # a request per step played, each submitted once
    assert sorted(k for _, keys in stream.log for k in keys) == sorted((s.traj, s.t) for s in cont.steps)
    for key in ("generate", "env", "env_wait", "hidden", "rollout"):
        assert cont.seconds[key] >= 0
    assert cont.seconds["env"] > 0 and cont.seconds["generate"] > 0


def test_a_prompt_enters_when_its_episode_is_ready_and_an_env_step_is_joined_one_engine_step_later():
    # episode 0's replies take 1 step, episode 1's 10: episode 0 goes on without waiting for it
    stream = FakeStream(length=lambda key: 1 if key[0] == 0 else 10)
    settings = RolloutSettings(max_turns=3, mode="continuous", invalid_action="stay")
    with VectorEnv("tiny", 2, env_kwargs={"size": 8, "goal_side": "right"}) as envs:
        rollout = run_rollouts(envs, [TaskRef(2, 0), TaskRef(2, 0)], stream, settings,  # walks of 3 steps
                               adapter=TextEnvAdapter(settings), env_runner=ThreadEnvRunner())
    entered = {key: steps for steps, keys in stream.log for key in keys}
    # (0, 0) finishes in step 1; its env step runs during step 2 and is joined after it;
    # (0, 1) enters before step 3, finishes in it, is joined after step 4, (0, 2) enters before 5
    assert entered[(0, 0)] == entered[(1, 0)] == 0
    assert entered[(0, 1)] == 2 and entered[(0, 2)] == 4
    # episode 1's turn 0 ends at step 10; nothing else is running, so its env step is joined at once
    assert entered[(1, 1)] == 10 and entered[(1, 2)] == 20
    assert rollout.engine_steps == 30 and [e.length for e in rollout.episodes] == [3, 3]
    assert [(s.traj, s.t) for s in rollout.steps] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]


def test_alone_in_the_engine_an_episode_is_joined_at_once():
    stream = FakeStream()
    with VectorEnv("tiny", 1, env_kwargs={"size": 8, "goal_side": "right"}) as envs:
        rollout = run_rollouts(envs, [TaskRef(2, 0)], stream, RolloutSettings(max_turns=3, mode="continuous"))
    assert [steps for steps, _ in stream.log] == [0, 1, 2] and rollout.engine_steps == 3


class JitteryAdapter(TextEnvAdapter):
    """Env steps that take a random wall time: the worker thread finishes at moments the loop
    cannot predict."""

    def __init__(self, settings, rng):
        super().__init__(settings)
        self.rng = rng

    def step(self, envs, actions):
        time.sleep(self.rng.random() * 0.004)
        return super().step(envs, actions)


def test_a_seed_repeats_a_stream_run_whatever_the_env_thread_does():
    def run(seed, jitter):
        def reply(key, messages):  # sampled per request from its own seed, as StreamTurns seeds vLLM
            return f"<action>{random.Random(f'{seed}-{key}').choice(['left', 'right', 'jump'])}</action>"

        stream = FakeStream(reply, length=lambda key: 1 + random.Random(f"{seed}-{key}").randrange(4), max_seqs=5)
        settings = RolloutSettings(max_turns=5, mode="continuous", rollout_batch_size=7)
        with VectorEnv("tiny", 12, backend="thread", num_workers=4) as envs:
            rollout = run_rollouts(envs, tasks(12, 4), stream, settings, adapter=JitteryAdapter(settings, random.Random(jitter)))
        return [(s.traj, s.t, s.reply, s.action, s.reward, s.anchor) for s in rollout.steps], stream.log, rollout.engine_steps

    first = run(3, jitter=0)
    assert run(3, jitter=1) == first
    assert run(4, jitter=0) != first  # the seed matters: the comparison can fail


def test_rollout_batch_size_caps_the_requests_in_the_engine():
    stream = FakeStream(length=lambda key: 1 + key[0] % 4)
    with VectorEnv("tiny", 10) as envs:
        rollout = run_rollouts(envs, tasks(10), stream, RolloutSettings(max_turns=3, mode="continuous", rollout_batch_size=3))
    assert max(stream.running) == 3 and len(rollout.steps) == sum(e.length for e in rollout.episodes)
    assert all(len(keys) <= 3 for _, keys in stream.log)


class BreaksOnTask3(TinyEnv):
    """Task 3's env raises on its second step (VectorEnv makes that an env failure)."""

    def reset(self, task_id):
        self.task_id, self.steps = task_id, 0
        return super().reset(task_id)

    def step(self, action):
        self.steps += 1
        if self.task_id == 3 and self.steps == 2:
            raise RuntimeError("env crashed")
        return super().step(action)


def test_a_failing_env_or_a_malformed_reply_ends_an_episode_not_the_run():
    def reply(key, messages):
        return "no action here" if key == (2, 0) else walk(messages)  # one malformed reply

    task_ids = [1, 3, 2, 8]  # walks of 2, 4, 3 and 3 steps
    stream = FakeStream(reply, length=lambda key: 1 + key[0])
    settings = RolloutSettings(max_turns=6, mode="continuous", invalid_action="stay")
    with VectorEnv(BreaksOnTask3, len(task_ids), env_kwargs={"size": 6}, backend="thread", num_workers=2) as envs:
        rollout = run_rollouts(envs, [TaskRef(t, i) for i, t in enumerate(task_ids)], stream, settings)
    failed = [e.failed for e in rollout.episodes]
    assert failed == [False, True, False, False] and "env crashed" in rollout.episodes[1].failure
    assert rollout.episodes[1].length == 2  # the failing step is recorded, and ends the episode
    assert rollout.episodes[2].invalid_steps == 1 and not rollout.steps[2].valid  # and it walked on
    assert rollout.episodes[2].won and rollout.episodes[2].length == 4
    assert all(e.won or e.truncated for e, f in zip(rollout.episodes, failed) if not f)
    assert not stream.queue and not stream.aborted


def test_an_error_in_the_loop_aborts_the_requests_left_in_the_engine():
    class Broken(TextEnvAdapter):
        def step(self, envs, actions):
            raise RuntimeError("adapter bug")

    stream = FakeStream(length=lambda key: 1 + 3 * key[0])
    settings = RolloutSettings(max_turns=3, mode="continuous")
    with VectorEnv("tiny", 2) as envs, pytest.raises(RuntimeError, match="adapter bug"):
        run_rollouts(envs, tasks(2), stream, settings, adapter=Broken(settings), env_runner=InlineEnvRunner())
    assert stream.aborted and not stream.queue


def test_a_stream_plays_continuous_only():
    with pytest.raises(ValueError, match="rollout_mode='lockstep' needs a generate callable"):
        run_rollouts(None, [], FakeStream(), RolloutSettings(mode="lockstep"))


def test_the_stream_counts_prompts_by_submission_and_reports_every_turn():
    turns = []
    stream = FakeStream(length=lambda key: 1 + key[0] % 2)
    with VectorEnv("tiny", 4) as envs:
        rollout = run_rollouts(envs, [TaskRef(3, 0)] * 4, stream, RolloutSettings(max_turns=3, mode="continuous"),
                               on_turn=lambda turn, playing: turns.append(turn))
    counts = rollout.prompt_counts
    assert counts["prompt_tokens"] == sum(len(s.prompt_ids) for s in rollout.steps)
    # the 4 copies of one task's first prompt entered together: 3 of them are shared
    assert counts["prompt_tokens_shared"] >= 3 * len(rollout.steps[0].prompt_ids)
    assert turns == sorted(set(turns)) and turns[0] == 0 and turns[-1] <= 2


def test_the_collector_streams_continuous_on_vllm_server_and_on_colocate_without_tensor_parallelism():
    from types import SimpleNamespace

    from bipace_trainer.rollout.collector import RolloutCollector
    from bipace_trainer.update.policy import TRLGeneration, TRLPolicy
    from bipace_trainer.rollout.vllm_stream import EngineStream, ServerStream, StreamTurns

    class Engine:  # what the collector's wrappers touch of TRL's colocated `LLM`
        def generate(self, *args, **kwargs):
            return []

    def collector(mode, vllm_mode="colocate", tp=1, use_vllm=True):
        args = SimpleNamespace(max_turns=2, history_length=1, rollout_batch_size=0, require_think=False, action_key_tokens=0,
                               rollout_mode=mode, vllm_mode=vllm_mode, vllm_tensor_parallel_size=tp, hidden_capture="hook",
                               per_device_train_batch_size=2, seed=0)
        runner = SimpleNamespace(device=SimpleNamespace(type="cuda"))  # not the CPU build: no weight shim
        llm = Engine()
        llm.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)))
        client = SimpleNamespace(base_url="http://127.0.0.1:1", model="m")  # never reached: nothing is submitted
        generation = SimpleNamespace(mode=vllm_mode, llm=llm if vllm_mode == "colocate" else None, vllm_client=client,
                                     sync_weights=lambda: None, tensor_parallel_size=tp)
        accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None), num_processes=2)
        policy = TRLPolicy(TRLGeneration(  # TRL's generation as the trainer hands it over; nothing here generates
            generate_single_turn=None, tokenize_prompts=None, tokenizer=SimpleNamespace(pad_token_id=0),
            processing_class=None, model=lambda: SimpleNamespace(training=True), model_wrapped=lambda: None,
            accelerator=accelerator, args=args, generation_config=None, generation_kwargs={},
            eos_token_ids=[1], step=lambda: 0, loaded_step=lambda step: 0, summon_full_params=None, profile=None,
            vllm_generation=generation if use_vllm else None,
        ))
        settings = RolloutSettings(max_turns=2, history_length=1, mode=mode)
        return RolloutCollector(policy, SimpleNamespace(env_class=None), settings, accelerator)

    for vllm_mode, engine in (("colocate", EngineStream), ("server", ServerStream)):
        streamed = collector("continuous", vllm_mode=vllm_mode)
        stream = streamed.generator("train")
        assert streamed.streams and isinstance(stream, StreamTurns) and isinstance(stream.engine, engine)
        assert isinstance(stream, StreamingGenerator)
        assert streamed.generator("train", mode="lockstep") == streamed.generate_turn
        stream.close()
    assert collector("continuous", vllm_mode="server", tp=2).streams  # the server's own TP is the server's business
    for plain in (collector("lockstep"), collector("continuous", tp=2), collector("lockstep", vllm_mode="server"),
                  collector("continuous", use_vllm=False)):
        assert not plain.streams and plain.generator("train") == plain.generate_turn
    assert collector("lockstep").generator("eval", mode="continuous") != collector("lockstep").generate_turn  # the bench's


def test_request_seeds_are_stable_and_distinct():
    from bipace_trainer.rollout.vllm_stream import request_seed

    seeds = {request_seed(0, step, name, traj, turn) for step in (0, 1) for name in ("train", "eval")
             for traj in range(8) for turn in range(4)}
    assert len(seeds) == 2 * 2 * 8 * 4 and all(0 <= s < 2**63 for s in seeds)
    assert request_seed(0, 1, "train", 3, 2) == 1504704514337113322  # the same in every process and run


class CallStream(FakeStream):
    """A `Generator` played as a stream: its reply to a request is made at submit (with the
    request's environment, as StreamTurns tokenizes with it) and leaves after `length(key)` steps."""

    def __init__(self, generate, length):
        super().__init__(length=length)
        self.generate = generate

    def submit(self, keys, messages, environments=None):
        self.log.append((self.steps, list(keys)))
        out = self.generate(messages, environments)
        for j, key in enumerate(keys):
            self.queue.append([key, out.prompt_ids[j], out.texts[j], self.length(key), out.completion_ids[j]])
        return out.prompt_ids

    def step(self):
        self.steps += 1
        done = [r for r in self.queue if r[3] <= 1]
        for r in self.queue:
            r[3] -= 1
        self.queue = [r for r in self.queue if r[3] > 0]
        return [r[0] for r in done], Generation([r[1] for r in done], [r[4] for r in done], [r[2] for r in done])


def test_trls_tool_envs_stream_the_same_chats_as_lockstep():
    """`ToolEnvAdapter` (TRL's environment_factory) through the stream: each prompt rendered with
    its episode's tool schema, the same steps, rewards and episodes as lockstep."""
    import functools

    from trl.chat_template_utils import add_response_schema

    from bipace_trainer.rollout.tool_envs import ToolEnvAdapter, ToolSession
    from tests.rollout.test_tool_envs import UNEQUAL_EPISODES, fake_setup, rows, scripted
    from tests.trainer.tool_setup import Lamps, make_tokenizer

    tokenizer = add_response_schema(make_tokenizer())
    scripts = UNEQUAL_EPISODES
    played = {}
    for mode in ("lockstep", "continuous"):
        trainer = fake_setup(tokenizer, Lamps)
        generate = scripted(tokenizer, trainer, scripts)
        if mode == "continuous":
            generate = CallStream(generate, length=lambda key: 1 + (key[0] * 7 + key[1]) % 3)
        tasks = [TaskRef(0, group=0, inputs=row) for row in rows(len(scripts))]
        session = functools.partial(ToolSession, trainer.environment_factories, [], trainer.multi_environment)
        with VectorEnv(session, len(tasks), backend="thread", num_workers=2) as envs:
            played[mode] = run_rollouts(envs, tasks, generate, RolloutSettings(max_turns=5, mode=mode),
                                        adapter=ToolEnvAdapter(trainer, num_user_reward_funcs=0))
    fields = lambda s: (s.traj, s.t, s.prompt_ids, s.completion_ids, s.action, s.anchor, s.reward, s.action_key)  # noqa: E731
    assert [fields(s) for s in played["lockstep"].steps] == [fields(s) for s in played["continuous"].steps]
    assert [vars(e) for e in played["lockstep"].episodes] == [vars(e) for e in played["continuous"].episodes]
    assert played["continuous"].engine_steps > 0 and [e.length for e in played["continuous"].episodes] == [3, 2, 2, 4, 1]
    assert [e.reward for e in played["continuous"].episodes] == [1.0, 0.5, 1.0, 0.5, 0.0]
