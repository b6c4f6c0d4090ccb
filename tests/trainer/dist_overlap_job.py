"""`max_staleness=1` on several processes: the runs test_distributed_overlap.py checks, under `accelerate launch`.

One launch trains the warm-started tiny policy (`--model`; a random one never earns a reward, so
its updates would all be skipped and the weights would never move) several times, one run after
the other in the same processes (the launch and the imports cost more than the tiny runs):

- "plain": max_staleness=0, one step: what the overlap's first step (played now, nothing
  prefetched yet) must equal;
- "straight": max_staleness=1, four steps, a checkpoint at step 2;
- "stopped": the same run, stopped after step 2 (its checkpoint holds the generation played
  during update 2, one file per rank): it must repeat "straight"'s first two steps;
- "resumed": "stopped" resumed from that checkpoint: it must end as "straight" did;
- "partial": resumed from a copy of that checkpoint without rank 1's file: rank 0 has a prefetched
  rollout for step 3 and rank 1 none, so both must play it now instead of waiting on each other.

(`--runs straight` trains only that one, as the ZeRO-2 check does.) Each rank writes
<out>/<run>_rank<k>.json: its log history, per training generation the tasks and completions it
played and the optimizer step whose weights played them (None: played now), a digest of the
trainable parameters after every optimizer step, and what `CollectiveThreads` saw.

`CollectiveThreads` counts every collective issued from Python (the methods of torch's
`ProcessGroup`, which `torch.distributed`'s functions, accelerate and DeepSpeed go through, and
DDP's buffer broadcast) by the thread that issued it: the background rollout must issue none,
and the main thread issuing some while it is alive shows the overlap really ran beside the
collectives. DDP's gradient all-reduce is issued from C++ inside backward, out of its sight: a
comm hook (DDP's default all-reduce, counted) records how many ran while the rollout was alive,
and `--hold` makes every background rollout wait for that all-reduce before it generates. `ddp_timeout`
is short, so a rank waiting on a collective the other never joins fails within 90 s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import threading
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402
from peft import LoraConfig  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402

from bipace_trainer import BiPACETrainer  # noqa: E402
from bipace_trainer.models import load_tokenizer  # noqa: E402
from bipace_trainer.update.overlap import SnapshotPolicy  # noqa: E402
from tests.trainer.tiny_setup import StopAfter, tiny_args  # noqa: E402

BACKGROUND = "bipace-rollout-overlap"  # the thread `update.overlap._Background` starts
COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "_allgather_base", "broadcast", "reduce", "gather", "scatter", "reduce_scatter", "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "barrier", "monitored_barrier", "send", "recv",
)


def _background_alive() -> bool:
    return any(t.name == BACKGROUND and t.is_alive() for t in threading.enumerate())


class CollectiveThreads:
    """Counts the collectives issued from Python by thread: main, background rollout, other."""

    def __init__(self):
        self.by_thread: Counter = Counter()
        self.main_while_background = 0
        for name in COLLECTIVES:
            original = getattr(dist.ProcessGroup, name, None)
            if original is not None:
                setattr(dist.ProcessGroup, name, self._counted(original))
        dist._broadcast_coalesced = self._counted(dist._broadcast_coalesced)  # DDP's buffer broadcast

    def _counted(self, original):
        def counted(*args, **kwargs):
            thread = threading.current_thread()
            if thread is threading.main_thread():
                self.by_thread["main"] += 1
                self.main_while_background += _background_alive()
            else:
                self.by_thread[thread.name] += 1
            return original(*args, **kwargs)

        return counted


ALLREDUCED = threading.Event()  # DDP's all-reduce of the update ran (`_counting_allreduce`)


def _counting_allreduce(counts: list[int], bucket):
    """DDP's own all-reduce of a gradient bucket (`allreduce_hook`), counting those issued while the
    background rollout is generating: DDP calls its comm hook from backward, as the all-reduce would run."""
    counts[0] += _background_alive()
    counts[1] += 1
    ALLREDUCED.set()
    return default_hooks.allreduce_hook(None, bucket)


def hold_rollouts_until_allreduce() -> None:
    """Under DDP, each background rollout generates its first turn only once the update beside it
    has all-reduced its gradients: the interleaving in which a collective on the background
    thread, or the main thread waiting on the rollout, would deadlock, made certain, whatever the
    machine's timing (the runs' results must not change: completions are timing-independent)."""
    refresh, generate = SnapshotPolicy.refresh, SnapshotPolicy.generate

    def held_refresh(self, step, seed):  # on the main thread, before the rollout starts
        ALLREDUCED.clear()
        self.held = True
        refresh(self, step, seed)

    def held_generate(self, prompt_ids, *args, **kwargs):
        if getattr(self, "held", False):
            if not ALLREDUCED.wait(timeout=60):
                raise TimeoutError("the update beside this background rollout never all-reduced its gradients")
            self.held = False
        return generate(self, prompt_ids, *args, **kwargs)

    SnapshotPolicy.refresh, SnapshotPolicy.generate = held_refresh, held_generate


def digest(model) -> str:
    """The trainable parameters, bit for bit (ranks in sync hold the same digest)."""
    sha = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        if param.requires_grad:
            sha.update(name.encode())
            sha.update(param.detach().float().cpu().numpy().tobytes())
    return sha.hexdigest()


class Digests(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.digests.append(digest(self.trainer.accelerator.unwrap_model(self.trainer.model)))


class OverlapRecorder(BiPACETrainer):
    """Records, per training generation, what this rank played and with which weights."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generations, self.digests = [], []
        self.allreduces_beside_background, self.hooked = [0, 0], False  # DDP's bucket all-reduces: (beside, all)
        self.add_callback(Digests(self))

    def on_scored(self, scored):
        if self.model.training:
            self.generations.append({
                "tasks": sorted({e.task_id for e in scored.rollout.episodes}),
                "completions": [s.completion_ids for s in scored.rollout.steps],
                "behaviour_step": scored.behaviour_step,
                "step": self.state.global_step,
            })
        return scored

    def training_step(self, model, inputs, num_items_in_batch=None):
        if isinstance(model, DistributedDataParallel) and not self.hooked:
            model.register_comm_hook(self.allreduces_beside_background, _counting_allreduce)
            self.hooked = True
        return super().training_step(model, inputs, num_items_in_batch)

    def evaluate_policy(self, tag="manual", split=None):
        return {}  # the evaluations are test_distributed.py's; here they would only cost time


def train(name, out, model_dir, collectives, resume=None, stop_after=None, **overrides):
    settings = dict(
        preset="bipace_q", gradient_accumulation_steps=1, evaluate_before_training=False, shuffle_dataset=False,
        disable_tqdm=True, ddp_timeout=90, env_step_timeout=30, max_staleness=1, max_steps=4, save_strategy="steps",
        save_steps=2,
    )  # one generation per optimizer step: 2 tasks × 4 episodes, 4 rows a rank
    settings.update(overrides)
    output_dir = Path(out) / ("stopped" if name == "resumed" else name)
    args = tiny_args(output_dir, **settings)
    trainer = OverlapRecorder(
        AutoModelForCausalLM.from_pretrained(model_dir), args=args, processing_class=load_tokenizer(model_dir),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    if stop_after:
        trainer.add_callback(StopAfter(stop_after))
    before = Counter(collectives.by_thread), collectives.main_while_background
    trainer.train(resume_from_checkpoint=resume)
    trainer.close_envs()
    rank = trainer.accelerator.process_index
    result = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "global_step": trainer.state.global_step,
        "logs": [e for e in trainer.state.log_history if "loss" in e],
        "generations": trainer.generations,
        "digests": trainer.digests,
        "collectives": dict(collectives.by_thread - before[0]),
        "collectives_beside_background": collectives.main_while_background - before[1],
        "allreduces_beside_background": trainer.allreduces_beside_background,
    }
    Path(out, f"{name}_rank{rank}.json").write_text(json.dumps(result))
    trainer.accelerator.wait_for_everyone()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True, help="the warm-started tiny policy (conftest's warm_policy_dir)")
    parser.add_argument("--hold", action="store_true", help="DDP: hold_rollouts_until_allreduce")
    parser.add_argument("--runs", default="plain,straight,stopped,resumed,partial")
    cli = parser.parse_args()
    runs = cli.runs.split(",")
    collectives = CollectiveThreads()
    if cli.hold:
        hold_rollouts_until_allreduce()
    if "plain" in runs:
        train("plain", cli.out, cli.model, collectives, max_staleness=0, max_steps=1, save_strategy="no")
    if "straight" in runs:
        train("straight", cli.out, cli.model, collectives)
    if "stopped" in runs:
        train("stopped", cli.out, cli.model, collectives, stop_after=2)
    if "resumed" in runs:
        train("resumed", cli.out, cli.model, collectives, resume=str(Path(cli.out, "stopped", "checkpoint-2")))
    if "partial" in runs:  # the checkpoint without rank 1's prefetched rollout
        source, partial = Path(cli.out, "stopped", "checkpoint-2"), Path(cli.out, "partial", "checkpoint-2")
        if int(os.environ["RANK"]) == 0:
            shutil.copytree(source, partial)
            (partial / "overlap_rollout_rank1.pt").unlink()
        dist.barrier()
        train("partial", cli.out, cli.model, collectives, resume=str(partial))
    os._exit(0)  # skip slow interpreter teardown of gloo/DeepSpeed groups


if __name__ == "__main__":
    main()
