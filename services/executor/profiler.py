"""torch.profiler over an executor's steps between start_profile and stop_profile (vLLM's
VLLM_TORCH_PROFILER_DIR): on stop, a Chrome/Perfetto trace of every operator, kernel and host
call (open it in ui.perfetto.dev) and tables of what took the most time (host time, and on a
GPU device time too), both under the server's --profiler-dir."""

import contextlib
import itertools
import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

TABLE_ROWS = 40


class StepProfiler:
    def __init__(self, directory: str | None, rank: int, device: torch.device) -> None:
        self.directory = directory
        self.rank = rank
        self.device = device
        self._profile: torch.profiler.profile | None = None
        self._count = itertools.count()

    def span(self, name: str) -> contextlib.AbstractContextManager[object]:
        """A named range of the trace while recording (the CPU's native kernels are no
        torch operators: only such ranges show where a step's host time went)."""
        if self._profile is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(name)

    def apply(self, action: str) -> None:
        """A plan's ``profile``: "start" or "stop"."""
        if self.directory is None:
            raise ValueError("this executor was started without --profiler-dir")
        if action == "start":
            self.start()
        else:
            self.stop()

    def start(self) -> None:
        if self._profile is not None:
            raise ValueError("a profile is already running")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.start()

    def stop(self) -> tuple[Path, Path]:
        """Stop recording and write the trace and the table; their paths."""
        if self._profile is None:
            raise ValueError("no profile is running")
        assert self.directory is not None
        profile, self._profile = self._profile, None
        profile.stop()
        folder = Path(self.directory)
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        stem = folder / f"executor{self.rank}-{stamp}-{os.getpid()}-{next(self._count)}"
        trace, table = stem.with_suffix(".trace.json"), stem.with_suffix(".txt")
        profile.export_chrome_trace(str(trace))
        averages = profile.key_averages()
        # On a GPU the kernels first; then, on both, where the host's time went (a launch
        # call that blocks shows there, not among the kernels).
        orders = ["self_device_time_total"] if self.device.type == "cuda" else []
        table.write_text(
            "\n".join(
                f"By {order}:\n"
                + averages.table(sort_by=order, row_limit=TABLE_ROWS, max_name_column_width=90)
                for order in [*orders, "self_cpu_time_total"]
            )
        )
        logger.info("executor %d wrote its profile: %s and %s", self.rank, trace, table)
        return trace, table
