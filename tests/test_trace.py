"""Trace: the bounded data model every consumer reads."""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest

from gpuwidget.trace import Trace

GPU_METRICS = ("util", "mem_util", "mem_used", "mem_total", "power", "power_limit", "temperature",
               "sm_clock", "sm_clock_max", "slowdown", "pcie_tx", "pcie_rx", "proc_mem",
               "sm_active", "tensor_active")


def eight_gpu_columns() -> list[str]:
    cols = [f"gpu{g}.{m}" for g in range(8) for m in GPU_METRICS]
    cols += ["cpu.util", "cpu.iowait", "proc.cpu", "proc.workers_cpu", "proc.workers", "proc.rss",
             "mem.used", "mem.total", "disk.read", "disk.write", "net.recv", "net.sent"]
    return cols + [f"cpu.core{i}.util" for i in range(16)]


def test_appended_rows_come_back_in_order_with_missing_fields_as_nan():
    trace = Trace()
    trace.append(0.0, {"gpu0.util": 10.0, "cpu.util": 5.0})
    trace.append(0.1, {"cpu.util": 6.0})
    trace.append(0.2, {"gpu0.util": 30.0, "cpu.util": 7.0})
    frame = trace.window()
    assert frame.t.tolist() == [0.0, 0.1, 0.2]
    assert frame["cpu.util"].tolist() == [5.0, 6.0, 7.0]
    util = frame["gpu0.util"]
    assert util[0] == 10.0 and math.isnan(util[1]) and util[2] == 30.0
    # Absent is not zero: the mean ignores the missing reading.
    assert trace.stats("gpu0.util").mean == pytest.approx(20.0)
    assert trace.stats("gpu0.util").count == 2


def test_window_slices_by_time_inclusively():
    trace = Trace()
    for i in range(100):
        trace.append(i * 0.1, {"x": float(i)})
    frame = trace.window(2.0, 3.0, ["x"])
    assert frame["x"].tolist() == [float(i) for i in range(20, 31)]
    assert len(trace.window(50.0, 60.0)) == 0


def test_unknown_column_reads_as_nan_not_error():
    trace = Trace()
    trace.append(0.0, {"x": 1.0})
    assert np.isnan(trace.window(columns=["nope"])["nope"]).all()
    assert trace.stats("nope") is None


def test_long_run_is_downsampled_but_keeps_spikes_and_exact_stats():
    trace = Trace(recent_capacity=256, archive_capacity=128, bucket_width_s=0.5)
    n = 20_000
    for i in range(n):
        value = 1000.0 if i == 1234 else float(i % 10)
        trace.append(i * 0.1, {"x": value, "y": -value})
    assert len(trace) <= 256 + 128
    assert trace.rows_total == n
    frame = trace.window()
    # The single-sample spike survives every merge, on both sides.
    assert np.nanmax(frame.max["x"]) == 1000.0
    assert np.nanmin(frame.min["y"]) == -1000.0
    stats = trace.stats("x")
    assert stats.count == n
    assert stats.max == 1000.0
    exact_mean = (sum(i % 10 for i in range(n)) - (1234 % 10) + 1000.0) / n
    assert stats.mean == pytest.approx(exact_mean)
    # The archive's bucket means are exact too (each bucket is a weighted mean).
    assert np.nansum(frame.mean["x"][: trace._arch_n] * trace._arch_count[: trace._arch_n, 0]) + np.nansum(
        frame.mean["x"][trace._arch_n:]) == pytest.approx(sum(i % 10 for i in range(n)) - 4 + 1000.0)
    # Time stays ordered across archive and recent rows.
    assert np.all(np.diff(frame.t) > 0)


def test_a_day_at_10_hz_with_eight_gpus_stays_under_64_mb():
    trace = Trace()
    columns = eight_gpu_columns()
    # Memory is set by the capacities and the column count, not by the run's length, so a
    # day at one row per 5 s fills every block as a day at 10 Hz would (the benchmark
    # appends the full 864,000 rows).
    row = {c: 1.0 for c in columns}
    for i in range(864_000 // 50):
        trace.append(i * 5.0, row)
    assert trace.duration >= 86_000
    assert trace.nbytes() < 64 * 2**20
    assert len(trace.plot_view(columns[:3], 2000)) <= 2000


def test_a_short_watch_with_eight_gpus_holds_memory_for_its_rows_not_the_capacity():
    trace = Trace()
    columns = eight_gpu_columns()
    trace.append(0.0, {c: 1.0 for c in columns})  # a watch's first tick
    assert trace.nbytes() < 1 * 2**20  # every block at full capacity: 25 MB for these columns
    # Grown a doubling at a time through the recent block's capacity and into the archive, every row stays.
    for i in range(1, 6000):
        trace.append(i * 0.25, {c: float(i) for c in columns[: 1 + i % len(columns)]})
    frame = trace.window()
    assert trace.rows_total == 6000 and np.all(np.diff(frame.t) > 0)
    assert frame.t[-1] == 5999 * 0.25 and frame[columns[0]][-1] == 5999.0
    last_seen = 1 + sum(1 for i in range(1, 6000) if i % len(columns) == len(columns) - 1)
    assert trace.stats(columns[0]).count == 6000 and trace.stats(columns[-1]).count == last_seen
    total = np.nansum(frame.mean[columns[0]][: trace._arch_n] * trace._arch_count[: trace._arch_n, 0])
    assert total + np.nansum(frame.mean[columns[0]][trace._arch_n:]) == pytest.approx(sum(range(6000)))


def test_plot_view_is_bounded_and_keeps_spikes_in_time_order():
    trace = Trace()
    for i in range(3000):
        trace.append(i * 0.01, {"u": 100.0 if i == 1500 else 10.0, "d": 0.0 if i == 700 else 50.0})
    view = trace.plot_view(["u", "d"], max_points=200)
    assert len(view) == 200
    assert view["u"].max() == 100.0
    assert view["d"].min() == 0.0
    assert np.all(np.diff(view.t) >= 0)


def test_spans_are_bounded_per_kind_but_stats_count_all():
    trace = Trace(span_capacity=100)
    for i in range(1000):
        trace.add_span("loader.wait", i, i + 0.25, {"step": i})
    trace.add_span("step", 0.0, 2.0)
    kept = trace.spans("loader.wait")
    assert len(kept) == 100
    assert kept[0].start == 900 and kept[-1].attrs == {"step": 999}
    stats = trace.span_stats("loader.wait")
    assert stats.count == 1000 and stats.total == pytest.approx(250.0)
    assert [s.kind for s in trace.spans(t0=0.0, t1=1.0)] == ["step"]
    assert trace.span_durations("loader.wait").tolist() == [0.25] * 100


def test_round_trip_through_json_keeps_rows_spans_and_stats():
    trace = Trace(recent_capacity=64, archive_capacity=32)
    for i in range(500):
        trace.append(i * 0.1, {"a": float(i), **({"b": 1.0} if i % 2 else {})})
        if i % 50 == 0:
            trace.add_span("loader.wait", i * 0.1, i * 0.1 + 0.05)
    trace.meta["label"] = "In [3]"
    data = json.loads(json.dumps(trace.to_dict(), allow_nan=False))
    copy = Trace.from_dict(data)
    a, b = trace.window(), copy.window()
    np.testing.assert_allclose(a.t, b.t)
    np.testing.assert_allclose(a["a"], b["a"], rtol=1e-6)
    np.testing.assert_allclose(a.max["a"], b.max["a"], rtol=1e-6)
    assert copy.stats("a") == trace.stats("a")
    assert copy.span_stats("loader.wait") == trace.span_stats("loader.wait")
    assert copy.meta == {"label": "In [3]"}
    # A loaded trace can keep recording.
    copy.append(100.0, {"a": 1.0})
    assert copy.rows_total == 501


def test_from_dict_rejects_other_data():
    with pytest.raises(ValueError, match="not a gpuwidget trace"):
        Trace.from_dict({"format": "something-else"})


def test_concurrent_writer_and_reader_do_not_corrupt():
    trace = Trace(recent_capacity=64, archive_capacity=16)
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                frame = trace.window(columns=["x"])
                assert len(frame.t) == len(frame["x"])
                trace.plot_view(["x"], 50)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(5000):
        trace.append(i * 0.01, {"x": float(i)})
    stop.set()
    thread.join()
    assert not errors
    assert trace.stats("x").count == 5000


def test_recent_rows_since_a_time_include_unknown_columns_as_nan():
    trace = Trace()
    for i in range(5):
        trace.append(float(i), {"x": float(i)})
    frame = trace.recent_since(2.0, ["x", "never"])
    assert frame["x"].tolist() == [3.0, 4.0]
    assert np.isnan(frame["never"]).all() and len(frame["never"]) == 2
