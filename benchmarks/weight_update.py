"""What new weights cost: `update_weights_from_disk` on a running engine against starting
the engine again on them (what serving new weights took before).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/weight_update.py [--model DIR] [--repeats 5]

Each update loads the model directory's weights into the running engine (pause, cache
dropped, every executor loads, resume) and is timed to its answer; each restart is
`LLM(model=DIR)` from nothing to its first generated token, the way a server is replaced.
Both read the same files (in the page cache after the first read). Prints the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

from weir.services import LLM
from weir.shared.model_store import resolve_model
from weir.shared.sampling import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a model directory (default: the default model)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = str(resolve_model(args.model))
    restarts = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        with LLM(model=model) as llm:
            llm.generate(["Hello"], ONE)
            restarts.append(time.perf_counter() - start)
    updates = []
    with LLM(model=model) as llm:
        llm.generate(["Hello"], ONE)
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.update_weights_from_disk(model)
            llm.generate(["Hello"], ONE)
            updates.append(time.perf_counter() - start)
    restart, update = statistics.median(restarts), statistics.median(updates)
    print(f"model {model}")
    print(
        f"restart to first token   median {restart * 1e3:8.0f} ms  ({', '.join(f'{t * 1e3:.0f}' for t in restarts)})"
    )
    print(
        f"update to first token    median {update * 1e3:8.0f} ms  ({', '.join(f'{t * 1e3:.0f}' for t in updates)})"
    )
    print(f"restart / update         {restart / update:.1f}x")


if __name__ == "__main__":
    main()
