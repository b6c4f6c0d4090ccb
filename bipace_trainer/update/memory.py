"""Bounds on a CPU training process's resident memory and LM-head work (measured in `bench/memory.py`
and `bench/memory_piece.py`, see docs/memory.md).

    with bound_cpu_memory(device):    # BiPACETrainer.train runs inside it; does nothing off a CPU
        ...

Two things made the main job's update peak at 7,465 MiB resident on a 135M model, neither of
them live tensors of the model's own size:

- TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`) scores the log-probs in tiles of
  `TOKEN_CHUNK_SIZE` (4096) tokens × `_CHUNKED_LOGPROB_CHUNK_SIZE` (32768) vocabulary entries.
  On a CUDA device a Triton kernel folds each tile in place; on a CPU the torch fallback makes
  about four float32 temporaries of the tile's size, and on a CPU every position of the piece is
  scored, the prompt's too (TRL keeps only the completion's positions where Triton runs). A
  piece of 4 rows × 460 tokens has 1,840 positions: a 236 MB tile and ~1 GB of temporaries in
  the forward, more in the backward. `trl_compat.logprob_tiles` makes the tiles 512 × 8192 (16 MB):
  the same arithmetic, in more, smaller tiles.
- glibc's malloc serves allocations under its mmap threshold from its heap, and raises that
  threshold (up to 32 MB) each time a mapped block is freed, so after the first few steps every
  activation tensor (4–11 MB here) comes from the heap, which fragments and is not given back:
  the update's freed activations stayed resident (4.5 GiB through the final evaluation). A fixed
  threshold (`return_freed_memory`) maps every block over 128 KiB on its own, and unmaps it on
  free, so the resident size follows the live tensors.

And one thing made the LM head's work ten times what it needs: on a CPU TRL scores every
position of a piece, the prompt's too, and drops all but the completion's afterwards
(`add_fused_lm_head` keeps only the labelled positions where `_use_triton` says a Triton device
runs, to spare other compilers a new tile shape per batch; an eager CPU has no such cost).
`trl_compat.labelled_positions_on_cpu` lets the CPU take TRL's compact path too: the same per-position
arithmetic on the ~40 completion positions of a ~460-token row instead of all of them.

The two TRL changes hold inside `bound_cpu_memory` only (TRL's values come back on exit, so
a plain `GRPOTrainer` in the same process is left as TRL makes it); the mmap threshold, a
setting of the C library, stays fixed for the rest of the process (glibc has no way back to
its dynamic threshold).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from typing import Iterator

from .. import trl_compat

__all__ = ["LOGPROB_TOKEN_TILE", "LOGPROB_VOCAB_TILE", "MMAP_THRESHOLD", "bound_cpu_memory", "return_freed_memory"]

# 512 tokens × 8192 vocabulary entries × 4 bytes = 16 MB per tile and per temporary.
LOGPROB_TOKEN_TILE = 512
LOGPROB_VOCAB_TILE = 8192
# glibc's own initial threshold, made fixed (setting it turns off the dynamic raise).
MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at `MMAP_THRESHOLD`, so freed tensors leave the resident set.

    Every block over the threshold is then mapped and zeroed afresh: the update piece ran ~35%
    longer (docs/memory.md). Returns False, changing nothing, where the C library is not glibc
    (musl, macOS) or where the user set glibc's own `MALLOC_MMAP_THRESHOLD_` (theirs wins; set
    it to 33554432 for glibc's dynamic behaviour's ceiling, faster and larger)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


@contextlib.contextmanager
def bound_cpu_memory(device) -> Iterator[bool]:
    """On a CPU, for the scope: TRL's fused LM head in `LOGPROB_TOKEN_TILE` × `LOGPROB_VOCAB_TILE`
    tiles over the labelled positions only, and glibc's mmap threshold fixed (`return_freed_memory`).
    Yields whether `device` is a CPU; off a CPU nothing changes (a GPU run's host memory and
    TRL's Triton path are left as they are)."""
    if getattr(device, "type", device) != "cpu":
        yield False
        return
    return_freed_memory()
    with trl_compat.logprob_tiles(device, LOGPROB_TOKEN_TILE, LOGPROB_VOCAB_TILE), trl_compat.labelled_positions_on_cpu(device):
        yield True
