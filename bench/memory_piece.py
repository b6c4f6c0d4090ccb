"""One update piece of the main job in isolation: the peak RSS of a forward and backward of 4 rows
× 460 tokens through the embedded SmolLM2-135M with LoRA and TRL's fused LM head, per setting.

    python -m bench.memory_piece tiles=trl checkpointing=off positions=all   # the main job's piece before the fix
    python -m bench.memory_piece tiles=small checkpointing=on     # after (the mmap threshold: MALLOC_MMAP_THRESHOLD_=131072)

`positions=all` is TRL's CPU path (every position through the LM head), `positions=labelled` (the
default) the trainer's: only the 40 completion positions of each row
(`bipace_trainer.trl_compat.labelled_positions_on_cpu`).

Prints one line: the RSS of the loaded model and the piece's peak above it (forward, forward and
backward; sampled every 10 ms in a thread), the seconds, and the log-probs' sum (the same for
every setting, to rounding). Run one setting per process: freed heap memory stays resident, so a
second setting in the same process would start from the first one's heap (`bench/memory.py`
measures the whole job).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time


def main(argv: list[str]) -> str:
    settings = dict(arg.split("=", 1) for arg in argv)
    import psutil
    import torch
    import trl.trainer.utils as trl_utils
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from bipace_trainer import trl_compat
    from bipace_trainer.update import memory
    from bipace_trainer.models import embedded_model_path

    model = AutoModelForCausalLM.from_pretrained(str(embedded_model_path()))
    trl_utils.add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    bounds = contextlib.ExitStack()  # held to the end of this process (one setting per process)
    if settings.get("tiles", "small") == "small":
        bounds.enter_context(trl_compat.logprob_tiles("cpu", memory.LOGPROB_TOKEN_TILE, memory.LOGPROB_VOCAB_TILE))
    if settings.get("positions", "labelled") == "labelled":
        bounds.enter_context(trl_compat.labelled_positions_on_cpu("cpu"))
    if settings.get("checkpointing", "on") == "on":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    torch.manual_seed(0)
    rows, prompt, completion = 4, 420, 40
    input_ids = torch.randint(0, 49000, (rows, prompt + completion))
    labels = input_ids.clone()
    labels[:, :-completion] = -100
    process, peak, done = psutil.Process(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.01)

    base = process.memory_info().rss
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels, fused_lm_head=True)
    forward_peak = peak[0]
    (out.log_probs.sum() + 0.01 * out.entropy.sum()).backward()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    mb = 2**20
    line = (f"{' '.join(argv) or 'defaults'}: model {base / mb:.0f} MB, forward +{(forward_peak - base) / mb:.0f} MB, "
            f"forward+backward +{(peak[0] - base) / mb:.0f} MB, {seconds:.1f} s, log-prob sum {float(out.log_probs.sum()):.4f}")
    print(line)
    return line


if __name__ == "__main__":
    main(sys.argv[1:])
