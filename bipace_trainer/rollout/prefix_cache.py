"""HF `generate` that prefills only the prompt tokens whose KV is not already known (`hf_prefix_cache`).

TRL's HF path left-pads the prompts and prefills every token. In a multi-turn rollout most of
them were seen before: a task's G rollouts share the system text and the task (at turn 0 the
whole prompt), and a TRL tool env's next prompt is the previous prompt + completion + tool reply.
`PrefixReuse.generate` finds, for each row, the longest prefix whose KV is known,

    (a) within the call: the longest prefix the row shares with another row of the batch (at
        least `min_shared` tokens). The distinct maximal shared prefixes get one forward pass
        (left-padded, `logits_to_keep=1`), and every row takes its slice of one of them;
    (b) across calls (`store_bytes > 0`): the longest prefix of a row that equals the tokens of
        a sequence this object generated before (a previous turn's prompt + completion, KV kept
        from that generate). Content-addressed, so no episode ids are needed. The store is
        bounded in bytes (least recently used entries go first), an entry is replaced by the
        longer sequence that extended it (an episode keeps one entry), and the collector clears
        it when a rollout ends (`clear`): the weights change after it.

and stitches one batch `DynamicCache` of width C (the longest cached prefix) in front of the
uncached tokens. Row i is laid out as

    [pad × (C - c_i) | cached prefix (c_i) | pad × (N - n_i) | uncached tokens (n_i)]

(N = the longest uncached part), the pads masked out by the attention mask. `generate` derives
position ids from the attention mask (`cumsum - 1`, `_prepare_position_ids_for_generation`), so
every real token keeps its position 0..len-1 whatever padding sits between them, and it slices
the input ids past the cache's length (`_prefill`), so only the N uncached columns are prefilled.
The last prompt token is never cached (c_i <= len_i - 1): the prefill must produce the next
token's logits, and `PrefillCapture` reads its hidden state at the last column, as with left
padding.

Counts (`take_counts`): `prompt_tokens_encoded` = prompt tokens the model computed (uncached
tokens + the shared-prefix pass), `prompt_tokens_reused` = the other prompt tokens (their KV
came from the shared pass or the store); the two add up to the prompt tokens.

Completions come back as TRL's `_generate_single_turn` returns them on the HF path: the ids after
the prompt, cut after the first EOS. The model must use a plain `DynamicCache` (full attention
on every layer): `supports_prefix_reuse` says whether it does.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .. import trl_compat

__all__ = ["PrefixReuse", "PrefixStore", "supports_prefix_reuse", "MIN_SHARED_TOKENS", "DEFAULT_STORE_BYTES"]

# A within-call shared prefix shorter than this is not worth its own forward pass (every prompt
# shares the chat template's first few tokens).
MIN_SHARED_TOKENS = 8
DEFAULT_STORE_BYTES = 256 * 2**20


def _base(model):
    """The transformers model under a PEFT wrapper (whose own signatures are **kwargs)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _cache_kwarg(model) -> str:
    """`cache` in recent transformers 5.x, `past_key_values` before (the name generate and forward take)."""
    params = inspect.signature(type(_base(model)).prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def supports_prefix_reuse(model) -> str:
    """"" when `model`'s generate can start from a stitched `DynamicCache`; else why not (for a warning)."""
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        return "a PEFT prompt-learning adapter adds virtual tokens to every forward"
    model = _base(model)
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return "it is not a decoder-only model"
    if not trl_compat.uses_default_dynamic_cache(model):
        return f"{type(model).__name__} does not use a DynamicCache"
    try:
        cache = DynamicCache(config=config.get_text_config(decoder=True))
    except Exception as error:  # noqa: BLE001 - any failure means: not this cache
        return f"a DynamicCache cannot be built for it ({error})"
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in cache.layers})
        return f"its cache layers are {kinds}, not plain full-attention DynamicLayers (sliding windows, linear attention)"
    return ""


def _common_prefix(a, b) -> int:
    """Length of the common prefix of two token sequences (lists or 1-D tensors)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    ta = a[:n] if isinstance(a, torch.Tensor) else torch.tensor(a[:n])
    tb = b[:n] if isinstance(b, torch.Tensor) else torch.tensor(b[:n])
    diff = (ta != tb).nonzero()
    return int(diff[0]) if len(diff) else n


@dataclass
class _Entry:
    ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, (H, len(ids), D) each
    nbytes: int
    tokens: torch.Tensor = None  # ids as a tensor, for matching

    def __post_init__(self):
        self.tokens = torch.tensor(self.ids, dtype=torch.long)


class PrefixStore:
    """Sequences generated before with their KV, least recently used first, at most `max_bytes`."""

    def __init__(self, max_bytes: int = DEFAULT_STORE_BYTES):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.nbytes = 0
        self._next = 0

    def __len__(self) -> int:
        return len(self.entries)

    def match(self, ids: list[int]) -> tuple[int | None, int]:
        """(key, length) of the entry sharing the longest prefix with `ids`; (None, 0) if none."""
        best, best_len = None, 0
        tokens = torch.tensor(ids, dtype=torch.long)
        for key, entry in self.entries.items():
            length = _common_prefix(entry.tokens, tokens)
            if length > best_len:
                best, best_len = key, length
        return best, best_len

    def get(self, key: int) -> _Entry:
        self.entries.move_to_end(key)
        return self.entries[key]

    def put(self, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], replaces: int | None = None) -> None:
        if replaces is not None and replaces in self.entries:
            self.nbytes -= self.entries.pop(replaces).nbytes
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if nbytes > self.max_bytes:
            return
        self.entries[self._next] = _Entry(list(ids), kv, nbytes)
        self._next += 1
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self.nbytes -= self.entries.popitem(last=False)[1].nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0


@dataclass
class _Source:
    """Where row i's cached prefix lives: a (layers of (B, H, L, D)) cache, its row and first column."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    row: int | None  # None: the tensors are (H, L, D), one sequence
    start: int
    length: int
    store_key: int | None = None


@dataclass
class Prepared:
    """One batch ready for `generate`: stitched inputs and cache, and what it reused."""

    prompt_ids: list[list[int]]
    input_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    cache: DynamicCache | None = None
    cached: list[int] = field(default_factory=list)  # c_i
    store_keys: list[int | None] = field(default_factory=list)
    encoded: int = 0
    reused: int = 0
    output: object = None  # generate's return value


class PrefixReuse:
    """HF generation with prefix reuse; one per collector (it holds the cross-call store and the counts)."""

    def __init__(self, store_bytes: int = DEFAULT_STORE_BYTES, min_shared: int = MIN_SHARED_TOKENS):
        self.store = PrefixStore(store_bytes) if store_bytes > 0 else None
        self.min_shared = max(1, min_shared)
        self.counts = {"prompt_tokens_encoded": 0, "prompt_tokens_reused": 0}

    def take_counts(self) -> dict[str, int]:
        counts, self.counts = self.counts, {"prompt_tokens_encoded": 0, "prompt_tokens_reused": 0}
        return counts

    def clear(self) -> None:
        """Forget the stored sequences (a rollout ended: the next one plays with new weights)."""
        if self.store is not None:
            self.store.clear()

    # -- planning
    def _shared_lengths(self, prompt_ids: list[list[int]]) -> list[int]:
        """For each row, the longest prefix it shares with another row (capped at len - 1): the
        maximum common prefix with any other row is reached at a lexicographic neighbour."""
        order = sorted(range(len(prompt_ids)), key=lambda i: prompt_ids[i])
        shared = [0] * len(prompt_ids)
        for a, b in zip(order, order[1:]):
            length = _common_prefix(prompt_ids[a], prompt_ids[b])
            shared[a], shared[b] = max(shared[a], length), max(shared[b], length)
        return [min(s, len(ids) - 1) for s, ids in zip(shared, prompt_ids)]

    @torch.no_grad()
    def prepare(self, model, prompt_ids: list[list[int]], pad_token_id: int) -> Prepared:
        """Find each row's cached prefix, run the shared-prefix pass, stitch the cache and inputs."""
        prompt_ids = [list(ids) for ids in prompt_ids]
        prepared = Prepared(prompt_ids)
        if not prompt_ids:
            return prepared
        if any(not ids for ids in prompt_ids):
            raise ValueError("PrefixReuse.generate got an empty prompt; every prompt needs at least one token.")
        device = model.device
        sources: list[_Source | None] = [None] * len(prompt_ids)
        if self.store is not None and len(self.store):
            for i, ids in enumerate(prompt_ids):
                key, length = self.store.match(ids)
                length = min(length, len(ids) - 1)
                if key is not None and length > 0:
                    sources[i] = _Source(self.store.get(key).kv, None, 0, length, store_key=key)
        shared = self._shared_lengths(prompt_ids)
        wants = [
            i for i, s in enumerate(shared) if s >= self.min_shared and s > (sources[i].length if sources[i] else 0)
        ]
        if wants:
            # The distinct maximal prefixes: a wanted prefix inside a longer wanted one takes its slice.
            maximal: list[int] = []  # rows whose prefix is computed
            owner: dict[int, int] = {}
            for i in sorted(wants, key=lambda r: -shared[r]):
                j = next((m for m in maximal if prompt_ids[m][: shared[i]] == prompt_ids[i][: shared[i]]), None)
                if j is None:
                    maximal.append(i)
                    j = i
                owner[i] = j
            lengths = [shared[m] for m in maximal]
            width = max(lengths)
            ids = torch.full((len(maximal), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(maximal), width), dtype=torch.long)
            for u, (m, length) in enumerate(zip(maximal, lengths)):
                ids[u, width - length :] = torch.tensor(prompt_ids[m][:length])
                mask[u, width - length :] = 1
            ids, mask = ids.to(device), mask.to(device)
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
            cache = DynamicCache(config=model.config.get_text_config(decoder=True))
            kwargs = {_cache_kwarg(model): cache, "use_cache": True}
            if "logits_to_keep" in inspect.signature(_base(model).forward).parameters:
                kwargs["logits_to_keep"] = 1
            model(input_ids=ids, attention_mask=mask, position_ids=position_ids, **kwargs)
            kv = [(layer.keys, layer.values) for layer in cache.layers]
            slot = {m: u for u, m in enumerate(maximal)}
            for i in wants:
                u = slot[owner[i]]
                sources[i] = _Source(kv, u, width - lengths[u], shared[i])
            prepared.encoded += sum(lengths)
        cached = [s.length if s else 0 for s in sources]
        total = sum(len(ids) for ids in prompt_ids)
        new = total - sum(cached)
        prepared.encoded += new
        prepared.reused = total - prepared.encoded
        prepared.cached = cached
        prepared.store_keys = [s.store_key if s else None for s in sources]
        self._stitch(prepared, sources, pad_token_id, device)
        return prepared

    def _stitch(self, prepared: Prepared, sources: list[_Source | None], pad_token_id: int, device) -> None:
        prompt_ids, cached = prepared.prompt_ids, prepared.cached
        rows, width = len(prompt_ids), max(cached)
        new_width = max(len(ids) - c for ids, c in zip(prompt_ids, cached))
        ids = torch.full((rows, width + new_width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((rows, width + new_width), dtype=torch.long)
        for i, (row, c) in enumerate(zip(prompt_ids, cached)):
            if c:
                ids[i, width - c : width] = torch.tensor(row[:c])
                mask[i, width - c : width] = 1
            rest = row[c:]
            ids[i, width + new_width - len(rest) :] = torch.tensor(rest)
            mask[i, width + new_width - len(rest) :] = 1
        prepared.input_ids, prepared.attention_mask = ids.to(device), mask.to(device)
        if width == 0:
            return  # nothing cached: generate as TRL does
        layers = next(s for s in sources if s is not None).kv
        data = []
        for layer, (k0, v0) in enumerate(layers):
            shape = (rows, k0.shape[-3], width, k0.shape[-1])
            keys = torch.zeros(shape, dtype=k0.dtype, device=k0.device)
            values = torch.zeros((rows, v0.shape[-3], width, v0.shape[-1]), dtype=v0.dtype, device=v0.device)
            for i, (source, c) in enumerate(zip(sources, cached)):
                if source is None:
                    continue
                k, v = source.kv[layer]
                if source.row is not None:
                    k, v = k[source.row], v[source.row]
                keys[i, :, width - c :] = k[:, source.start : source.start + c]
                values[i, :, width - c :] = v[:, source.start : source.start + c]
            data.append((keys, values))
        prepared.cache = DynamicCache(data)

    # -- generation
    @torch.no_grad()
    def generate(
        self, model, prepared: Prepared, generation_config, eos_token_ids, remember: bool = True, counted: bool = True,
        **kwargs,
    ):
        """model.generate over the prepared batch; completions cut after the first EOS, as TRL's HF path.
        `remember`: keep the rows' sequences in the store; `counted`: add the call to `take_counts`."""
        if counted:
            self.counts["prompt_tokens_encoded"] += prepared.encoded
            self.counts["prompt_tokens_reused"] += prepared.reused
        if not prepared.prompt_ids:
            return []
        cache = prepared.cache
        if cache is None and self.store is not None and remember:
            cache = DynamicCache(config=model.config.get_text_config(decoder=True))  # kept to fill the store
        if cache is not None:
            kwargs[_cache_kwarg(model)] = cache
        output = model.generate(
            input_ids=prepared.input_ids, attention_mask=prepared.attention_mask,
            generation_config=generation_config, **kwargs,
        )
        prepared.output = output  # with return_dict_in_generate: scores etc., for tests and benches
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        width = prepared.input_ids.shape[1]
        completion = sequences[:, width:]
        eos = torch.tensor(list(eos_token_ids), device=completion.device)
        is_eos = torch.isin(completion, eos)
        ends = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full_like(is_eos[:, 0], completion.shape[1], dtype=torch.long))
        completion_ids = [row[:end].tolist() for row, end in zip(completion.cpu(), ends.cpu())]
        if self.store is not None and remember and cache is not None:
            self._remember(prepared, cache, completion_ids, completion.shape[1])
        return completion_ids

    def _remember(self, prepared: Prepared, cache: DynamicCache, completion_ids: list[list[int]], steps: int) -> None:
        """Keep each row's prompt + completion with its KV (the last generated token was never fed)."""
        width = prepared.input_ids.shape[1]
        mask = prepared.attention_mask.bool()
        for i, (prompt, completion) in enumerate(zip(prepared.prompt_ids, completion_ids)):
            fed = min(len(completion), steps - 1)
            columns = torch.cat(
                [mask[i].nonzero().flatten(), torch.arange(width, width + fed, device=mask.device)]
            )
            kv = [(layer.keys[i][:, columns].clone(), layer.values[i][:, columns].clone()) for layer in cache.layers]
            self.store.put(prompt + completion[:fed], kv, replaces=prepared.store_keys[i])
