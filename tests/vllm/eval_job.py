"""`bipace-eval --use_vllm` with the real vLLM engine (CPU build), colocated.

Run by tests/vllm/test_vllm_engine.py in the venv of tests/vllm/make_venv.sh, on the model
tests/vllm/vllm_job.py saved:

    PYTHONPATH=. $(bash tests/vllm/make_venv.sh) tests/vllm/eval_job.py --out result.json -- MODEL [MODEL] FLAGS

Runs `bipace_trainer.cli.evaluate.main` three times in this process with the same flags: the
second is a rerun that must replay nothing; before the third, the last chunk's line is cut
from every model's episodes file (an evaluation killed during its last chunk), which the
third must replay in a fresh engine, as the first played it. Counts, around each run, the vLLM engines
built (`vllm.LLM.__init__`), the prompts they generated for (`vllm.LLM.generate`) and the
calls to transformers' own `generate` (which must be none: every reply came from vLLM), and
how many earlier engines were still alive when one was built (the first model's engine must
be freed before the second model's is built).
"""

from __future__ import annotations

import argparse
import json
import time
import weakref
from pathlib import Path

from tests.vllm.job import write_result


def main() -> None:
    import transformers
    import vllm

    from bipace_trainer.cli import evaluate

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="bipace-eval's flags, after --")
    args = parser.parse_args()
    flags = [f for f in args.flags if f != "--"] if args.flags[:1] == ["--"] else args.flags

    counts = {"engines": 0, "engine_generate_calls": 0, "engine_prompts": 0, "hf_generate_calls": 0, "alive_at_build": 0}

    def counted(cls, name, key, per_call=None):
        original = getattr(cls, name)

        def wrapper(self, *a, **k):
            counts[key] += 1
            if per_call is not None:
                counts[per_call] += len(a[0] if a else k.get("prompts", []))
            return original(self, *a, **k)

        setattr(cls, name, wrapper)

    counted(vllm.LLM, "__init__", "engines")
    engines: list[weakref.ref] = []
    original_init = vllm.LLM.__init__

    def tracked(self, *a, **k):  # how many earlier engines were still alive when this one was built
        counts["alive_at_build"] = max(counts["alive_at_build"], sum(r() is not None for r in engines))
        engines.append(weakref.ref(self))
        return original_init(self, *a, **k)

    vllm.LLM.__init__ = tracked
    counted(vllm.LLM, "generate", "engine_generate_calls", "engine_prompts")
    counted(transformers.GenerationMixin, "generate", "hf_generate_calls")

    settings = evaluate.parse_args(flags)
    labels: list[str] = []
    for spec in settings.models:
        labels.append(evaluate.model_label(spec, labels))
    files = [Path(settings.output_dir) / label / evaluate.EPISODES_FILE for label in labels]
    runs, cut, replies = [], {}, {}
    for number in range(3):
        if number == 2:
            for path in filter(Path.is_file, files):
                lines = path.read_text().splitlines(keepends=True)
                cut[path.parent.name] = json.loads(lines[-1])
                path.write_text("".join(lines[:-1]))
                replies[path.parent.name] = chunk_replies(path.parent, cut[path.parent.name])
        before, start = dict(counts), time.perf_counter()
        counts["alive_at_build"] = 0
        evaluate.main(flags)
        runs.append({k: counts[k] - before[k] for k in counts} | {"alive_at_build": counts["alive_at_build"]}
                    | {"seconds": time.perf_counter() - start})  # fmt: skip
    resumed = {label: chunk_replies(Path(settings.output_dir) / label, line) for label, line in cut.items()}
    result = {"runs": runs, "cut": cut, "cut_replies": replies, "resumed_replies": resumed}
    write_result(args, result)


def chunk_replies(folder: Path, line: dict) -> list[list[str]]:
    """The replies, episode by episode, of the dumped chunk of an episodes-file line."""
    (dump,) = (folder / "rollouts").glob(f"eval-{line['split']}-seed{line['seed']}-chunk{line['chunk']:04d}-*.jsonl")
    return [[turn["reply"] for turn in json.loads(row)["turns"]] for row in dump.read_text().splitlines()]


if __name__ == "__main__":  # vLLM may spawn workers: the guard keeps them from re-running the job
    main()
