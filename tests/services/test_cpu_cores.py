"""CPU defaults: the cores a process may use (affinity, cgroup quota) and how `weir serve` /
``LLM`` share them between executors and the scheduler; checked on real processes too."""

import os
from pathlib import Path

import pytest

from weir.services import LLM
from weir.services.cpu_cores import (
    CpuBudget,
    available_cpus,
    cgroup_cpu_quota,
    cpus_of_quota,
    executor_threads,
    format_cores,
    parse_cfs_quota,
    parse_cores,
    parse_cpu_max,
    plan_cpus,
)


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("max 100000\n", None), ("150000 100000\n", 1.5), ("400000 100000", 4.0), ("50000", 0.5)],
)
def test_cpu_max_is_read_as_cpus(text, cpus):
    assert parse_cpu_max(text) == cpus


def test_cfs_quota_is_read_as_cpus():
    assert parse_cfs_quota("-1\n", "100000\n") is None
    assert parse_cfs_quota("250000\n", "100000\n") == 2.5


@pytest.mark.parametrize(("quota", "threads"), [(0.5, 1), (1.0, 1), (1.5, 1), (2.0, 2), (3.99, 3)])
def test_a_fractional_quota_is_floored_to_at_least_one_thread(quota, threads):
    assert cpus_of_quota(quota) == threads


def _fake_cgroup_root(root: Path, mountinfo: str, membership: str, files: dict[str, str]) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/mountinfo").write_text(mountinfo)
    (root / "proc/self/cgroup").write_text(membership)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_cgroup_v2_quota_is_the_smallest_on_the_path_to_the_root(tmp_path):
    root = _fake_cgroup_root(
        tmp_path,
        "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
        "0::/kubepods/pod1/ctr\n",
        {
            "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "max 100000\n",
            "sys/fs/cgroup/kubepods/pod1/cpu.max": "300000 100000\n",
            "sys/fs/cgroup/kubepods/cpu.max": "800000 100000\n",
        },
    )
    assert cgroup_cpu_quota(root) == 3.0


def test_cgroup_v1_quota_inside_a_container_mount(tmp_path):
    # Docker without a cgroup namespace: the mount's root is the container's own cgroup.
    root = _fake_cgroup_root(
        tmp_path,
        "40 31 0:29 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpu,cpuacct\n"
        "41 31 0:30 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n",
        "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n",
        {
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "150000\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_cpu_quota(root) == 1.5


def test_no_quota_and_no_cgroup_filesystem_mean_no_limit(tmp_path):
    root = _fake_cgroup_root(
        tmp_path / "unlimited",
        "30 25 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        "0::/\n",
        {"sys/fs/cgroup/cpu.max": "max 100000\n"},
    )
    assert cgroup_cpu_quota(root) is None
    assert cgroup_cpu_quota(tmp_path / "nothing-mounted") is None


def test_the_quota_caps_the_affinity_set():
    assert CpuBudget((0, 1, 2, 3, 4, 5, 6, 7), 2.5).count == 2
    assert CpuBudget((0, 1), 6.0).count == 2
    assert CpuBudget((3, 5)).count == 2
    mine = available_cpus()
    assert mine.cores == tuple(sorted(os.sched_getaffinity(0))) and 1 <= mine.count


def test_two_cores_one_executor_takes_both_and_nothing_is_pinned():
    plan = plan_cpus(CpuBudget((0, 1)), num_executors=1)
    assert (plan.executor_threads, plan.executor_cores, plan.service_cores) == (2, (None,), None)


def test_from_four_cores_one_is_kept_for_the_scheduler_and_gateway():
    plan = plan_cpus(CpuBudget(tuple(range(8))), num_executors=1)
    assert plan.executor_threads == 7
    assert plan.executor_cores == ((1, 2, 3, 4, 5, 6, 7),)
    assert plan.service_cores == (0,)


def test_executor_ranks_split_the_cores_instead_of_each_taking_all():
    plan = plan_cpus(CpuBudget(tuple(range(8))), num_executors=2)
    assert plan.executor_threads == 3
    assert plan.executor_cores == ((1, 2, 3), (4, 5, 6))
    assert plan.service_cores == (0, 7)
    two_on_two = plan_cpus(CpuBudget((0, 1)), num_executors=2)
    assert two_on_two.executor_threads == 1 and two_on_two.executor_cores == ((0,), (1,))


def test_more_ranks_than_cores_get_one_thread_each_unpinned():
    plan = plan_cpus(CpuBudget((0, 1)), num_executors=4)
    assert plan.executor_threads == 1 and plan.executor_cores == (None,) * 4


def test_a_quota_below_the_affinity_set_sizes_threads_but_pins_nothing():
    # Other pods of the node may share the same cores: pinning would stack them up.
    plan = plan_cpus(CpuBudget(tuple(range(16)), 4.0), num_executors=1)
    assert plan.executor_threads == 3
    assert plan.executor_cores == (None,) and plan.service_cores is None


def test_explicit_threads_win_and_pin_nothing():
    plan = plan_cpus(CpuBudget(tuple(range(8))), num_executors=2, threads=5)
    assert plan.executor_threads == 5 and plan.executor_cores == (None, None)
    assert executor_threads(3) == 3
    assert executor_threads(None) == available_cpus().count
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        plan_cpus(CpuBudget((0, 1)), num_executors=1, threads=0)


def test_cpu_lists_round_trip():
    assert format_cores((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert parse_cores("0-2,5,7-8") == (0, 1, 2, 5, 7, 8)
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cores("a-b")


def test_llm_executor_uses_the_detected_cores_whatever_omp_num_threads_says(
    tiny_model_dir, monkeypatch
):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the children inherit it
    plan = plan_cpus(available_cpus(), num_executors=1)
    with LLM(str(tiny_model_dir), kv_cache_memory="1MiB") as llm:
        [executor] = llm.server_info["executors"]
    assert executor["threads"] == plan.executor_threads
    assert executor["cores"] == list(plan.executor_cores[0] or available_cpus().cores)
    with LLM(str(tiny_model_dir), kv_cache_memory="1MiB", threads=1) as llm:
        [executor] = llm.server_info["executors"]
    assert executor["threads"] == 1
    assert executor["cores"] == list(available_cpus().cores)


def test_tensor_parallel_ranks_on_one_machine_split_the_cores(tiny_model_dir):
    plan = plan_cpus(available_cpus(), num_executors=2)
    with LLM(str(tiny_model_dir), kv_cache_memory="1MiB", tensor_parallel_size=2) as llm:
        executors = llm.server_info["executors"]
    assert [e["threads"] for e in executors] == [plan.executor_threads] * 2
    for executor, cores in zip(executors, plan.executor_cores):
        assert executor["cores"] == list(cores or available_cpus().cores)
