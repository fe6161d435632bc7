"""bench.rawload's steady figure: broker CPU per MiB acknowledged from STEADY_FROM_S on (a
fresh broker's first GiB fills its LogCache with fresh memory), beside the whole run's."""
from __future__ import annotations

import math
import os
import time

from bench import rawload


def test_cpu_per_mib_counts_only_what_was_acknowledged_from_the_mark() -> None:
    mib = 1 << 20
    acks = [(1.0, 4 * mib), (2.0, 4 * mib), (3.0, 2 * mib), (4.0, 2 * mib)]
    # 0.8 s of CPU from t=3 on, over the 4 MiB acknowledged from then: 200 ms per MiB
    assert math.isclose(rawload.cpu_ms_per_mib_after(acks, 3.0, 10.0, 10.8), 200.0)
    assert math.isnan(rawload.cpu_ms_per_mib_after(acks, 5.0, 10.0, 10.8))


def test_the_later_sample_reads_the_process_cpu_after_its_delay() -> None:
    t0 = time.perf_counter()
    before = rawload.process_cpu_s(os.getpid())
    mark = rawload._LaterSample(os.getpid(), 0.2)
    end = time.process_time() + 0.3
    while time.process_time() < end:       # burn CPU across the mark
        pass
    mark.join()
    assert mark.at is not None and mark.at - t0 >= 0.2
    assert before <= mark.cpu <= rawload.process_cpu_s(os.getpid())


def test_the_kernel_part_is_the_system_time_within_the_cpu_figure() -> None:
    """The split under the steady figure: system time read from /proc, never above the whole
    CPU time of the same reading, and it grows with work done in the kernel."""
    from bench.common import stat_cpu_split
    user0, kernel0 = stat_cpu_split(f"/proc/{os.getpid()}/stat")
    with open("/dev/zero", "rb", buffering=0) as f:
        end = time.process_time() + 0.3
        while time.process_time() < end:       # 64 MiB reads: kernel time (page zeroing)
            f.read(64 << 20)
    user1, kernel1 = stat_cpu_split(f"/proc/{os.getpid()}/stat")
    assert kernel1 > kernel0 and user1 >= user0
    mark = rawload._LaterSample(os.getpid(), 0.0)
    mark.join()
    assert 0 <= mark.kernel <= mark.cpu
    assert math.isnan(rawload.process_cpu_kernel_s(rawload.MOCK_PID)[1])
    assert stat_cpu_split("/proc/does-not-exist/stat") is None


def test_cpu_by_thread_group_names_the_main_thread_and_strips_pool_indexes() -> None:
    """CPU by thread pool: the main thread is "event-loop"; other threads count under their
    kernel name without the pool index, two threads of one pool in one group; the CPU a
    thread burns shows in its group's per-MiB figure between two readings."""
    import threading

    from bench.common import groups_ms_per_mib
    from broker.thread_names import name_current_thread

    started, stop = threading.Barrier(3), threading.Event()

    def burn(name: str, seconds: float) -> None:
        name_current_thread(name)
        started.wait()
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        stop.wait()

    threads = [threading.Thread(target=burn, args=(f"s3kafka-burn_{i}", 0.15 * (i + 1)))
               for i in range(2)]
    before = rawload.process_pools_cpu(os.getpid())
    for t in threads:
        t.start()
    started.wait()
    deadline = time.monotonic() + 10
    after = rawload.process_pools_cpu(os.getpid())
    while after.get("s3k-burn", 0.0) - before.get("s3k-burn", 0.0) < 0.40 and \
            time.monotonic() < deadline:
        time.sleep(0.05)
        after = rawload.process_pools_cpu(os.getpid())
    stop.set()
    for t in threads:
        t.join()
    assert "event-loop" in after
    assert not any(g.startswith("s3k-burn_") for g in after)
    per = groups_ms_per_mib(before, after, 2.0)          # as if 2 MiB were acknowledged
    # 0.15 + 0.30 s of thread CPU over 2 MiB: ~225 ms per MiB (ticks: 10 ms each)
    assert 190 <= per["s3k-burn"] <= 300
    assert list(per.values()) == sorted(per.values(), reverse=True)   # largest first
    assert groups_ms_per_mib(before, after, 0.0) == {}
    assert rawload.process_pools_cpu(rawload.MOCK_PID) == {}
