"""Attention alone, forward and backward, for the shared-prefix forward's packed rows: the ways to attend
a cluster `[prefix | suffix 1 | ... | suffix k]` without letting suffixes see each other, side by side.

    python -m bench.packed_attention                         # prefixes of 1K, 2K, 4K and 8K tokens
    python -m bench.packed_attention --prefixes 1024 --out bench/results/packed_attention.json

Shapes are SmolLM2-135M's attention (9 query heads, 3 key-value heads of 64) on float32; k = 4 suffixes of
240 tokens (a context row of `bench.shared_prefix`: 200 tokens of its own and a 40-token reply). Each variant
runs in its own process (its peak resident memory is its own), one after the other for each prefix:

- `plain`: the plain path, the 4 rows whole (P + 240 tokens each, no padding: SDPA's fused causal kernel);
- `mask`: one packed row under the materialised (1, 1, N, N) boolean mask (the layout before issue 60);
- `segments`: `packed_attention.segment_attention` (the prefix one causal call, the suffixes one batched call);
- `flex`: FlexAttention with a block mask, compiled (`dynamic=True`), where torch can run its backward.
Prints seconds (CPU and wall) and peak memory above the process's start; `--out` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HEADS, KV_HEADS, DIM, SUFFIXES, SUFFIX = 9, 3, 64, 4, 240
VARIANTS = ("plain", "mask", "segments", "flex")


def inputs(rows: int, width: int, heads: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, heads, width, DIM, generator=generator, requires_grad=True)


def attend(variant: str, prefix: int):
    """The variant's output (its backward is run by the caller)."""
    import torch
    import torch.nn.functional as F

    from bipace_trainer.update.packed_attention import Cluster, SegmentLayout, segment_attention
    from bipace_trainer.update.shared_prefix import attention_mask_4d

    groups, width = HEADS // KV_HEADS, prefix + SUFFIXES * SUFFIX
    if variant == "plain":
        rows = prefix + SUFFIX
        query, key, value = inputs(SUFFIXES, rows, HEADS), inputs(SUFFIXES, rows, KV_HEADS), inputs(SUFFIXES, rows, KV_HEADS)
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    query, key, value = inputs(1, width, HEADS), inputs(1, width, KV_HEADS), inputs(1, width, KV_HEADS)
    segment = torch.tensor([[0] * prefix + [k + 1 for k in range(SUFFIXES) for _ in range(SUFFIX)]])
    if variant == "mask":
        mask = attention_mask_4d(segment, "bool", torch.float32)
        repeat = lambda states: states.repeat_interleave(groups, dim=1)  # noqa: E731
        return F.scaled_dot_product_attention(query, repeat(key), repeat(value), attn_mask=mask)
    if variant == "segments":
        suffixes = tuple((prefix + k * SUFFIX, SUFFIX) for k in range(SUFFIXES))
        return segment_attention(query, key, value, SegmentLayout([[Cluster(0, prefix, suffixes)]], width), groups)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    codes = segment[0]
    block_mask = create_block_mask(lambda b, h, q, k: (q >= k) & ((codes[k] == 0) | (codes[k] == codes[q])),
                                   1, None, width, width, device="cpu")
    return torch.compile(flex_attention, dynamic=True)(query, key, value, block_mask=block_mask, enable_gqa=True)


def measure(variant: str, prefix: int) -> dict:
    """One forward and backward in this process: seconds and peak memory above the start."""
    import torch

    torch.set_num_threads(1)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start, cpu = time.perf_counter(), time.process_time()
    try:
        attend(variant, prefix).sum().backward()
    except Exception as error:  # noqa: BLE001 -- a variant torch cannot run here is a result, not a crash
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
            "peak_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefixes", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # a child process: variant, prefix
    cli = parser.parse_args(argv)
    if cli.one:
        print(json.dumps(measure(cli.one[0], int(cli.one[1]))))
        return {}
    results = {}
    for prefix in cli.prefixes:
        for variant in cli.variants:
            child = subprocess.run([sys.executable, "-m", "bench.packed_attention", "--one", variant, str(prefix)],
                                   capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            lines = child.stdout.strip().splitlines()
            results[f"{variant}/{prefix}"] = json.loads(lines[-1]) if lines else {"error": child.stderr[-300:]}
            print(variant, prefix, results[f"{variant}/{prefix}"], "load", os.getloadavg()[0], flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "load_average": os.getloadavg(), "results": results,
              "command": "python -m bench.packed_attention " + " ".join(argv if argv is not None else sys.argv[1:])}
    if cli.out:
        Path(cli.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cli.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
