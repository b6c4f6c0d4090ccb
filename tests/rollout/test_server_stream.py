"""The continuous rollout through a vLLM server (`vllm_stream.ServerStream`): one HTTP request
per episode turn, collected as replies come back. The server here is a real HTTP server on
localhost that answers vLLM's `/v1/completions` the way vLLM does (token ids in and out,
logprobs as "token_id:N", `usage.prompt_tokens_details.cached_tokens` from a block prefix
cache), replying to each prompt with the tiny env's optimal move after a delay chosen per
request seed. TRL's own client (`VLLMClient._post`) and TRL's own server-mode generate send
through it. The real vLLM server is tested in tests/vllm/ (slow)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import requests

from bipace_trainer.rollout.loop import Generation, RolloutSettings, TaskRef, run_rollouts
from bipace_trainer.update.policy import TRLGeneration, TRLPolicy
from bipace_trainer.rollout.vllm_stream import ServerStream, StreamTurns, request_seed, server_sampling_params
from envs.vector import VectorEnv

BLOCK = 16  # the fake server's prefix-cache block


def walk(text: str) -> str:
    return "<action>left</action>" if "to your left" in text else "<action>right</action>"


class FakeVLLMServer:
    """vLLM's `/v1/models` and `/v1/completions` for one prompt per request, on a free port.

    Prompt ids are the UTF-8 bytes of the prompt text; the reply is `walk(text)` as bytes,
    sent after `delay(seed)` seconds. `log` holds (arrival, departure, body) per request;
    a body with `"max_tokens": 0` gets a 400, as vLLM answers a bad request."""

    def __init__(self, delay=lambda seed: 0.0):
        self.delay, self.log, self.seen = delay, [], []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"data": [{"id": "fake-model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                arrived = time.monotonic()
                if body.get("max_tokens") == 0:
                    self._send(400, {"error": {"message": "max_tokens must be at least 1"}})
                    return
                time.sleep(server.delay(body.get("seed")))
                reply = server.complete(body)
                with server.lock:  # logged before the reply goes: a client never sees an unlogged reply
                    server.log.append((arrived, time.monotonic(), body))
                self._send(200, reply)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def complete(self, body):
        choices, prompt_tokens, cached = [], 0, 0
        for prompt in body["prompt"]:
            with self.lock:  # the longest block-aligned prefix any earlier prompt shares
                best = max((_common(prompt, seen) for seen in self.seen), default=0)
                self.seen.append(list(prompt))
            prompt_tokens, cached = len(prompt), (best // BLOCK) * BLOCK
            tokens = list(walk(bytes(prompt).decode()).encode())[: body["max_tokens"]]
            logprobs = [-0.25] * len(tokens)
            for _ in range(body.get("n", 1)):
                choices.append({
                    "index": len(choices), "token_ids": tokens, "prompt_token_ids": list(prompt),
                    "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": logprobs,
                                 "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(tokens, logprobs)]},
                })
        usage = {"prompt_tokens": prompt_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
        return {"choices": choices, "usage": usage}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def trl_client(url: str):
    """TRL's `VLLMClient` on `url`, its session and `_post` as TRL builds them (its constructor
    refuses to run without vLLM installed, so the attributes it sets are set here)."""
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient.__new__(VLLMClient)
    client.session, client.base_url = requests.Session(), url
    client.model = client._get(f"{url}/v1/models")["data"][0]["id"]
    return client


def trl_generation(client, **overrides):
    """TRL's `VLLMGeneration` in server mode on `client`, with the sampling settings a trainer gives it."""
    from accelerate import PartialState
    from trl.generation.vllm_generation import VLLMGeneration

    PartialState(cpu=True)
    generation = VLLMGeneration.__new__(VLLMGeneration)
    settings = dict(mode="server", vllm_client=client, temperature=0.9, top_p=0.95, top_k=20, min_p=None,
                    repetition_penalty=1.05, max_completion_length=24, logprobs=0, structured_outputs_regex=None,
                    generation_kwargs={}, enable_sleep_mode=False)
    settings.update(overrides)
    for name, value in settings.items():
        setattr(generation, name, value)
    generation.accelerator = SimpleNamespace(process_index=0, is_main_process=True)
    return generation


@pytest.fixture
def server():
    srv = FakeVLLMServer()
    yield srv
    srv.close()


@pytest.mark.parametrize("overrides", [
    {},
    {"structured_outputs_regex": r"<action>\w+</action>"},
    {"generation_kwargs": {"frequency_penalty": 0.2, "seed": 11}, "min_p": 0.05},
])
def test_a_request_is_trls_server_payload_for_one_completion_plus_its_seed(server, overrides):
    client = trl_client(server.url)
    generation = trl_generation(client, **overrides)
    prompt = list("You are in a corridor.".encode())
    generation.generate(prompts=[prompt], images=None, num_generations=1)  # TRL's own server branch
    stream = ServerStream(client)
    stream.submit("k", prompt, server_sampling_params(generation, seed=1234))
    while len(stream):
        stream.step()
    stream.close()
    trl_body, ours = server.log[0][2], server.log[1][2]
    assert ours.pop("seed") == 1234
    trl_body.pop("seed", None)  # a user's generation_kwargs seed: the stream's per-request seed replaces it
    assert ours == trl_body


def test_replies_are_collected_as_they_finish_and_stay_with_their_prompts():
    delays = {1: 0.3, 2: 0.0, 3: 0.1}
    srv = FakeVLLMServer(delay=lambda seed: delays[seed])
    try:
        stream = ServerStream(trl_client(srv.url), poll_seconds=0.01)
        prompts = {key: list(f"episode {key}: the goal is to your {side}".encode())
                   for key, side in ((1, "left"), (2, "right"), (3, "left"))}
        for key, prompt in prompts.items():
            stream.submit(key, prompt, {"max_tokens": 32, "seed": key, "logprobs": 0})
        order, rounds = [], 0
        while len(stream):
            finished = stream.step()
            rounds += 1
            for f in finished:
                order.append(f.key)
                assert f.prompt_token_ids == prompts[f.key]
                assert bytes(f.completion_ids).decode() == walk(bytes(prompts[f.key]).decode())
                assert f.logprobs == [-0.25] * len(f.completion_ids)
        stream.close()
    finally:
        srv.close()
    assert order == [2, 3, 1]  # as they finished, not as they were sent
    assert rounds > 3  # steps came back empty while the slow reply was out: env steps could land meanwhile


def test_a_failed_request_raises_from_step_and_abort_drops_the_rest():
    srv = FakeVLLMServer(delay=lambda seed: 0.5 if seed == 2 else 0.0)
    try:
        stream = ServerStream(trl_client(srv.url), poll_seconds=0.05)
        stream.submit("bad", [65, 66], {"max_tokens": 0, "seed": 1})
        stream.submit("slow", [65, 67], {"max_tokens": 8, "seed": 2})
        with pytest.raises(RuntimeError, match=r"failed the request of 'bad'.*400.*max_tokens must be at least 1"):
            for _ in range(100):
                stream.step()
        stream.abort()
        assert len(stream) == 0 and stream.step() == []
        with pytest.raises(RuntimeError, match="shutdown"):  # the pool is shut: nothing more goes out on this stream
            stream.submit("late", [65], {"max_tokens": 8, "seed": 3})
    finally:
        srv.close()


class Tokenizer:
    """Prompt ids = UTF-8 bytes of the last message (what the fake server decodes)."""

    @staticmethod
    def batch_decode(ids, skip_special_tokens=True):
        return [bytes(i).decode() for i in ids]


def tokenize(messages, environments=None):
    return [list(m[-1]["content"].encode()) for m in messages]


def fake_policy(client, num_processes=1, global_step=0, last_loaded=-1):
    """The trainer's `TRLPolicy` over TRL's server generation, with the trainer's step and TRL's
    `_last_loaded_step` as values (`loaded[0]`), weight pushes and barriers recorded."""
    pushes, barriers, loaded = [], [], [last_loaded]
    generation = trl_generation(client, max_completion_length=64, temperature=1.0)
    generation.sync_weights = lambda: pushes.append(global_step)
    accelerator = SimpleNamespace(num_processes=num_processes, is_main_process=True, device="cpu",
                                  wait_for_everyone=lambda: barriers.append(len(pushes)))

    def loaded_step(step):
        if step is not None:
            loaded[0] = step
        return loaded[0]

    trl = TRLGeneration(
        generate_single_turn=None, tokenize_prompts=tokenize, tokenizer=SimpleNamespace(pad_token_id=0),
        processing_class=Tokenizer(), model=None, model_wrapped=None, accelerator=accelerator,
        args=SimpleNamespace(seed=7, report_to=[], per_device_train_batch_size=4, vllm_mode="server"),
        generation_config=None, generation_kwargs={}, eos_token_ids=[0], step=lambda: global_step,
        loaded_step=loaded_step, summon_full_params=None, profile=lambda name: contextlib.nullcontext(),
        vllm_generation=generation,
    )
    return TRLPolicy(trl), pushes, barriers, loaded


def test_episodes_play_through_the_server_on_their_own_and_match_lockstep():
    """Episode 0's first reply takes 0.4 s; the others' replies come at once. Their next turns
    reach the server while episode 0's first request is still out, and the rollout's records
    equal lockstep's (records are sorted into lockstep's order at the end)."""
    n = 6
    slow = request_seed(7, 0, "train", 0, 0)
    srv = FakeVLLMServer(delay=lambda seed: 0.4 if seed == slow else 0.0)
    try:
        policy, pushes, barriers, loaded = fake_policy(trl_client(srv.url), num_processes=2)
        counter = policy.prefix_cache  # a server's: its streamed replies report cached prompt tokens
        stream = StreamTurns(policy, name="train")
        # the weights moved when the stream was built (the step changed), then every rank waited
        assert pushes == [0] and barriers == [1] and loaded == [0]
        settings = RolloutSettings(max_turns=4, mode="continuous")
        tasks = [TaskRef(i % 12, group=i // 3) for i in range(n)]
        with VectorEnv("tiny", n, env_kwargs={"size": 8}) as envs:
            played = run_rollouts(envs, tasks, stream, settings)

        def lockstep_policy(messages, environments=None):
            ids = tokenize(messages)
            replies = [walk(bytes(p).decode()) for p in ids]
            return Generation(ids, [list(r.encode()) for r in replies], replies, logprobs=[[-0.25] * len(r) for r in replies])

        with VectorEnv("tiny", n, env_kwargs={"size": 8}) as envs:
            lock = run_rollouts(envs, tasks, lockstep_policy, RolloutSettings(max_turns=4, mode="lockstep"))
    finally:
        srv.close()
    fields = lambda s: (s.traj, s.t, s.prompt_ids, s.completion_ids, s.reply, s.action, s.reward, s.sampling_logprobs)
    assert [fields(s) for s in played.steps] == [fields(s) for s in lock.steps]
    assert [vars(e) for e in played.episodes] == [vars(e) for e in lock.episodes]
    assert max(e.length for e in played.episodes) > 1 and any(e.won for e in played.episodes)
    # one request per env step, each with its own seed, sent by this rank (no gather)
    seeds = [body["seed"] for *_, body in srv.log]
    assert len(seeds) == len(played.steps) == len(set(seeds))
    # while episode 0's first request was out, later turns of other episodes came and went
    (slow_in, slow_out, _), = [(a, d, b) for a, d, b in srv.log if b["seed"] == slow]
    later = [b for a, d, b in srv.log if slow_in < a and d < slow_out]
    assert later, "no request of a later turn was served while the slow one was out"
    # prompt tokens reused: the server's own report, summed
    counts = counter.take()
    assert counts["prompt_tokens_encoded"] + counts["prompt_tokens_reused"] == sum(len(s.prompt_ids) for s in played.steps)
    assert counts["prompt_tokens_reused"] > 0  # the group's copies share their first prompt
    # a stream built again in the same step moves nothing
    StreamTurns(policy, name="eval").close()
    assert pushes == [0] and barriers == [1]
