"""How many CPU cores Weir's processes may use, and how `weir serve` / ``LLM`` share them out.

The cores available to a process are its CPU affinity set (``taskset``, a cpuset cgroup,
Kubernetes' static CPU manager) capped by its cgroup's CPU quota (a pod's CPU limit:
cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, the smallest along
the cgroup's ancestors). A fractional quota is floored, with a minimum of one: more
threads than the quota pays for get throttled in the middle of a step, which costs more
than the fraction buys. ``os.cpu_count()`` is never used: it counts the host's cores.

An executor's torch thread count, in order of precedence:

1. ``--threads N`` (``threads=N`` in ``LLM``): exactly N, nothing pinned;
2. otherwise, an executor run alone (``weir executor``, Kubernetes): the cores available;
3. under ``weir serve`` / ``LLM``: the supervisor's split (``plan_cpus``).

``OMP_NUM_THREADS`` does not count: the executor sets torch's intra-op threads (and one
inter-op thread) itself, and its environment's ``OMP_NUM_THREADS`` to its thread count
(see ``weir.services.cli``).
The scheduler and the gateway run torch-free hot paths, so they get one OpenMP/BLAS
thread whatever the environment says (``SERVICE_THREAD_ENV``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

# With this many cores or more, one is kept for the scheduler and the gateway; below it
# they share the executor's cores (they sleep on sockets most of a step, and on two cores
# one executor thread fewer costs far more than the scheduler's interruptions).
SERVICE_CORE_MIN_CORES = 4
# Thread pools a numerical import may start; the scheduler and the gateway get one each.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def single_thread_env() -> dict[str, str]:
    """The environment of a process that must not start thread pools."""
    return {name: "1" for name in THREAD_ENV_VARS}


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD") -> CPUs, None if unlimited."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    period = int(parts[1]) if len(parts) > 1 else 100_000
    return _quota_cpus(int(parts[0]), period)


def parse_cfs_quota(quota_us: str, period_us: str) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` -> CPUs, None if unlimited (-1)."""
    return _quota_cpus(int(quota_us), int(period_us))


def _quota_cpus(quota: int, period: int) -> float | None:
    if quota < 0 or period <= 0:
        return None
    return quota / period


def cpus_of_quota(quota: float) -> int:
    """Whole threads a quota of ``quota`` CPUs pays for: floored, at least one."""
    return max(1, math.floor(quota + 1e-9))


def cgroup_cpu_quota(root: Path = Path("/")) -> float | None:
    """The smallest CPU quota on this process's cgroup and its ancestors, in CPUs; None when
    none is set or the cgroup filesystem is not mounted. ``root`` is for tests."""
    limits = [q for q in _quotas(root) if q is not None]
    return min(limits) if limits else None


def _quotas(root: Path) -> list[float | None]:
    try:
        memberships = (root / "proc/self/cgroup").read_text().splitlines()
        mounts = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    quotas: list[float | None] = []
    for mount_root, mount_point, version in _cpu_cgroup_mounts(mounts):
        for line in memberships:
            hierarchy, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if (version == 2) != (hierarchy == "0" and controllers == ""):
                continue
            if version == 1 and "cpu" not in controllers.split(","):
                continue
            # Inside a cgroup namespace the path is relative to the mount's root already.
            if path.startswith(mount_root) and mount_root != "/":
                path = path[len(mount_root) :]
            directory = root / mount_point.lstrip("/") / path.lstrip("/")
            top = root / mount_point.lstrip("/")
            while True:
                quotas.append(_read_quota(directory, version))
                if directory == top or top not in directory.parents:
                    break
                directory = directory.parent
    return quotas


def _cpu_cgroup_mounts(mountinfo: list[str]) -> list[tuple[str, str, int]]:
    """(root, mount point, version) of every cgroup mount that holds the cpu controller."""
    found = []
    for line in mountinfo:
        fields, _, tail = line.partition(" - ")
        parts, tail_parts = fields.split(), tail.split()
        if len(parts) < 5 or len(tail_parts) < 3:
            continue
        fstype, super_options = tail_parts[0], tail_parts[2].split(",")
        if fstype == "cgroup2":
            found.append((parts[3], parts[4], 2))
        elif fstype == "cgroup" and "cpu" in super_options:
            found.append((parts[3], parts[4], 1))
    return found


def _read_quota(directory: Path, version: int) -> float | None:
    try:
        if version == 2:
            return parse_cpu_max((directory / "cpu.max").read_text())
        return parse_cfs_quota(
            (directory / "cpu.cfs_quota_us").read_text(),
            (directory / "cpu.cfs_period_us").read_text(),
        )
    except (OSError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class CpuBudget:
    """The cores this process may run on (its affinity set) and the CPUs its quota pays for."""

    cores: tuple[int, ...]
    quota: float | None = None

    @property
    def count(self) -> int:
        """Threads that can run at once: the affinity set, capped by the quota."""
        if self.quota is None:
            return len(self.cores)
        return min(len(self.cores), cpus_of_quota(self.quota))

    @property
    def owns_cores(self) -> bool:
        """Whether the affinity set is the limit, so pinning to its cores loses nothing (with
        a lower quota every process of the node may share those cores: pinning would pile
        processes onto the same few)."""
        return self.quota is None or self.quota >= len(self.cores)


def available_cpus() -> CpuBudget:
    """This process's affinity set and cgroup CPU quota."""
    return CpuBudget(tuple(sorted(os.sched_getaffinity(0))), cgroup_cpu_quota())


def executor_threads(requested: int | None) -> int:
    """An executor's torch threads: ``requested`` (``--threads``), else the cores available."""
    if requested is not None:
        if type(requested) is not int or requested < 1:
            raise ValueError(f"threads must be an int >= 1, got {requested!r}")
        return requested
    return available_cpus().count


@dataclass(frozen=True, slots=True)
class CpuPlan:
    """How `weir serve` / ``LLM`` run their processes: each executor rank's thread count and
    cores (None: not pinned), and the cores of the scheduler and gateway (None: not pinned)."""

    executor_threads: int
    executor_cores: tuple[tuple[int, ...] | None, ...]
    service_cores: tuple[int, ...] | None

    def describe(self) -> str:
        ranks = "; ".join(
            f"executor {rank}: {self.executor_threads} thread(s)"
            + (f" on cores {format_cores(cores)}" if cores else "")
            for rank, cores in enumerate(self.executor_cores)
        )
        service = (
            f"cores {format_cores(self.service_cores)}" if self.service_cores else "not pinned"
        )
        return f"{ranks}; scheduler and gateway: 1 thread, {service}"


def plan_cpus(budget: CpuBudget, num_executors: int, threads: int | None = None) -> CpuPlan:
    """Share ``budget`` between ``num_executors`` executor ranks and the scheduler + gateway.

    With ``threads`` given every rank runs that many threads and nothing is pinned. Otherwise,
    from ``SERVICE_CORE_MIN_CORES`` cores up, one core is kept for the scheduler and the
    gateway; the rest is split evenly between the ranks (each rank at least one thread).
    Cores are pinned only when the affinity set is the limit (``CpuBudget.owns_cores``) and
    every rank gets cores of its own: the service core(s) first, then one contiguous slice
    per rank; cores left over by an uneven split go to the scheduler and gateway.
    """
    if num_executors < 1:
        raise ValueError(f"num_executors must be >= 1, got {num_executors}")
    unpinned = (None,) * num_executors
    if threads is not None:
        return CpuPlan(executor_threads(threads), unpinned, None)
    reserve = 1 if budget.count >= SERVICE_CORE_MIN_CORES else 0
    per_rank = max(1, (budget.count - reserve) // num_executors)
    if not budget.owns_cores or budget.count - reserve < num_executors:
        return CpuPlan(per_rank, unpinned, None)
    cores = budget.cores
    used = reserve + per_rank * num_executors
    ranks = tuple(
        cores[reserve + rank * per_rank : reserve + (rank + 1) * per_rank]
        for rank in range(num_executors)
    )
    service = cores[:reserve] + cores[used:]
    if not service and num_executors == 1:
        return CpuPlan(per_rank, unpinned, None)  # one executor on every core: nothing to pin
    return CpuPlan(per_rank, ranks, service or None)


def format_cores(cores: tuple[int, ...] | list[int]) -> str:
    """(0, 1, 2, 5) -> '0-2,5' (the kernel's cpu list format)."""
    spans: list[list[int]] = []
    for core in sorted(cores):
        if spans and spans[-1][1] == core - 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in spans)


def parse_cores(text: str) -> tuple[int, ...]:
    """'0-2,5' -> (0, 1, 2, 5)."""
    cores: set[int] = set()
    try:
        for part in filter(None, text.split(",")):
            low, _, high = part.partition("-")
            cores.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ValueError(f"not a CPU list: {text!r} (e.g. 0-3,6)") from None
    if not cores:
        raise ValueError(f"not a CPU list: {text!r} (e.g. 0-3,6)")
    return tuple(sorted(cores))
