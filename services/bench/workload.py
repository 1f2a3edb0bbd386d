"""Benchmark workloads: seeded random token-id prompts, or a JSONL file of prompts.

Every engine in one run receives the same token ids and the same output lengths;
string prompts from a dataset are tokenized once here, so no engine tokenizes
differently from another.
"""

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

# A short prompt every engine generates from once before its timed run (lazy init, allocator growth).
WARMUP_PROMPT = (1000, 1001, 1002, 1003)


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass(slots=True)
class RandomWorkload:
    num_prompts: int
    input_len_min: int
    input_len_max: int
    output_len_min: int
    output_len_max: int
    seed: int


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer of a model directory, or of the directory given as --tokenizer."""
    path = Path(directory) / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises a bare Exception
        raise ValueError(f"{path}: cannot be read: {exc}") from None


def normal_vocab_ids(tokenizer: Tokenizer) -> list[int]:
    """Token ids of the base vocabulary, without special/added tokens (EOS, chat markers)."""
    added = set(tokenizer.get_added_tokens_decoder())
    return [i for i in range(tokenizer.get_vocab_size(with_added_tokens=False)) if i not in added]


def random_requests(spec: RandomWorkload, vocab_ids: list[int]) -> list[BenchRequest]:
    if not 1 <= spec.input_len_min <= spec.input_len_max:
        raise ValueError(
            f"need 1 <= --input-len-min <= --input-len-max, got {spec.input_len_min}, {spec.input_len_max}"
        )
    if not 1 <= spec.output_len_min <= spec.output_len_max:
        raise ValueError(
            f"need 1 <= --output-len-min <= --output-len-max, got {spec.output_len_min}, {spec.output_len_max}"
        )
    rng = random.Random(spec.seed)
    requests = []
    for _ in range(spec.num_prompts):
        input_len = rng.randint(spec.input_len_min, spec.input_len_max)
        output_len = rng.randint(spec.output_len_min, spec.output_len_max)
        requests.append(BenchRequest(rng.choices(vocab_ids, k=input_len), output_len))
    return requests


def load_dataset(
    path: Path, tokenizer: Tokenizer, num_prompts: int | None = None
) -> list[BenchRequest]:
    """Read {"prompt": str | list[int], "output_len": int} per line; blank lines are skipped."""
    requests = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                prompt, output_len = record["prompt"], record["output_len"]
            except (ValueError, KeyError, TypeError):  # not JSON, not an object, a key missing
                prompt, output_len = None, None
            if type(output_len) is not int or not (
                isinstance(prompt, str)
                or isinstance(prompt, list)
                and all(type(t) is int for t in prompt)
            ):
                raise ValueError(
                    f"{path}:{line_no}: need 'prompt' (text or token ids) and an integer "
                    "'output_len'"
                )
            ids = tokenizer.encode(prompt).ids if isinstance(prompt, str) else prompt
            if not ids or output_len < 1:
                raise ValueError(f"{path}:{line_no}: empty prompt or output_len < 1")
            requests.append(BenchRequest(ids, output_len))
            if num_prompts is not None and len(requests) == num_prompts:
                break
    return requests


def describe_workload(requests: list[BenchRequest], args: argparse.Namespace) -> str:
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    output_lens = [r.output_len for r in requests]
    source = (
        f"dataset {args.dataset}"
        if args.dataset is not None
        else f"random token ids, seed {args.seed}"
    )
    return (
        f"{len(requests)} requests ({source}); prompt lengths {min(prompt_lens)}-{max(prompt_lens)} "
        f"({sum(prompt_lens)} tokens), output lengths {min(output_lens)}-{max(output_lens)} "
        f"({sum(output_lens)} tokens), greedy, EOS ignored"
    )


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_workload_arguments(parser: argparse.ArgumentParser, num_prompts: int) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--num-prompts", type=positive_int, default=num_prompts, help="number of requests"
    )
    g.add_argument("--input-len-min", type=positive_int, default=32)
    g.add_argument("--input-len-max", type=positive_int, default=256)
    g.add_argument("--output-len-min", type=positive_int, default=32)
    g.add_argument("--output-len-max", type=positive_int, default=128)
    g.add_argument(
        "--seed", type=int, default=0, help="seed of the random prompts, lengths and arrivals"
    )
    g.add_argument(
        "--dataset",
        type=Path,
        default=None,
        help='JSONL file of {"prompt": text or token ids, "output_len": n} (replaces the random prompts; '
        "--num-prompts still caps the count)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="the directory of the tokenizer the model is served with (weir serve --tokenizer), "
        "which tokenizes --dataset's texts and whose vocabulary random prompts draw from "
        "(default: the model's own)",
    )


def workload_from_args(args: argparse.Namespace, tokenizer: Tokenizer) -> list[BenchRequest]:
    if args.dataset is not None:
        requests = load_dataset(args.dataset, tokenizer, args.num_prompts)
    else:
        spec = RandomWorkload(
            num_prompts=args.num_prompts,
            input_len_min=args.input_len_min,
            input_len_max=args.input_len_max,
            output_len_min=args.output_len_min,
            output_len_max=args.output_len_max,
            seed=args.seed,
        )
        requests = random_requests(spec, normal_vocab_ids(tokenizer))
    if not requests:
        raise ValueError("the workload is empty")
    return requests
