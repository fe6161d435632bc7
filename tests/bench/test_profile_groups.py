"""bench.profile --perf: the broker's samples regrouped by Python thread group (perf knows
threads only by id), so a start-up job still running in the window shows as its own group."""
from __future__ import annotations

import os

from bench import profile

REPORT = """\
# Samples: 100  of event 'cpu-clock:ppp'
# Overhead  Pid:Command  Symbol
    40.00%     11:python        [k] _copy_to_iter
    10.00%     11:python        [.] _PyEval_EvalFrameDefault
    15.00%     12:python        [k] clear_page_erms
     6.00%     13:python        [.] copy_crc_fold_stream
     5.00%     14:python        [.] copy_crc_fold_stream
     1.50%     14:python        [k] finish_task_switch.isra.0
     0.50%     15:iou-wrk-11    [k] io_wq_worker
"""


def test_samples_regrouped_by_thread_group() -> None:
    names = {11: "MainThread", 12: "s3kafka-frames_0", 13: "s3kafka-io_0", 14: "s3kafka-io_3"}
    text = profile.by_thread_group(REPORT, names, n=2)
    lines = text.splitlines()
    shares = lines[1:5]
    assert shares == ["  50.0%  MainThread", "  15.0%  s3kafka-frames", "  12.5%  s3kafka-io",
                      "   0.5%  tid 15"]
    io = lines[lines.index("s3kafka-io: top symbols, % of all broker samples") + 1:][:2]
    assert io == [" 11.00%  copy_crc_fold_stream", "  1.50%  finish_task_switch.isra.0"]
    assert "# Overhead" not in text


def test_thread_names_empty_without_py_spy(tmp_path) -> None:
    assert profile.thread_names(str(tmp_path / "no-py-spy"), os.getpid()) == {}
