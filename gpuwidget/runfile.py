"""Run files on disk: written without following links or sharing a temporary file, read with suspicion.

A saved run may come from anywhere (a colleague, a CI artefact, an attacker), so loading
checks the whole shape first and raises one error type, :class:`RunFormatError`, with
the first thing that is wrong. Every size the file states (row counts, column lengths)
must agree with what it actually holds, so what loading allocates is bounded by the
file's own length, never by a number written in it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RUN_FORMAT = "gpuwidget.run/1"
TRACE_FORMAT = "gpuwidget.trace/1"
# Read when /proc does not tell (not Linux): the usual default.
DEFAULT_UMASK = 0o022
# Per-column counts are stored as uint32 in the Trace.
MAX_COUNT = 2**32 - 1


class RunFormatError(ValueError):
    """The file is not a gpuwidget run as :meth:`Run.save` writes it; the message says what is wrong."""


# ----------------------------------------------------------------- writing


def save_target(path: str | os.PathLike[str]) -> Path:
    """The file a save goes to, with ``..`` taken as the shell's ``cd`` takes it: ``a/../b`` is ``b``.

    So a folder named before a ``..`` is never created just to be left again.
    """
    return Path(os.path.normpath(os.fspath(path)))


def unwritable_reason(target: Path) -> str | None:
    """Why ``target`` cannot be written (checked before a watched cell runs), or None.

    Missing folders are fine (saving creates them) as long as the nearest existing one
    is a folder this process may write into.
    """
    if target.is_dir():
        return f"{str(target)!r} is a folder"
    folder = target.parent
    while not folder.exists():
        if folder.is_symlink():
            return f"{str(folder)!r} is a broken link"
        folder = folder.parent
    if not folder.is_dir():
        return f"{str(folder)!r} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write in {str(folder)!r}"
    return None


def write_atomic(target: Path, text: str, *, private: bool = False) -> None:
    """Write ``text`` to ``target`` through a fresh temporary file beside it, then rename.

    ``mkstemp`` creates the temporary file with O_EXCL: it never opens an existing file
    or follows a link planted under its name, and two saves never share one. The rename
    replaces ``target`` itself (a link there is replaced, not followed), and a reader
    sees the old file or the new one, never half of one. ``private`` keeps it readable by its
    owner only (0600); otherwise it gets the mode any new file would.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        if not private:  # mkstemp made it 0600
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _umask() -> int:
    """This process's umask without changing it (os.umask sets it, racing with other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return DEFAULT_UMASK


# ----------------------------------------------------------------- reading


def read_json(path: str | os.PathLike[str]) -> Any:
    """The file's JSON; NaN and Infinity (which JSON does not have) read as null, i.e. "n/a"."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle, parse_constant=lambda _name: None)
    except UnicodeDecodeError as error:
        raise RunFormatError(f"not a saved gpuwidget run: not UTF-8 text ({error.reason})") from None
    except json.JSONDecodeError as error:
        raise RunFormatError(f"not a saved gpuwidget run: not JSON ({error})") from None


def check_run(data: Any) -> None:
    """Raise :class:`RunFormatError` unless ``data`` has the shape ``Run.to_dict()`` gives."""
    if not isinstance(data, Mapping):
        raise RunFormatError(f"not a saved gpuwidget run: a JSON {type(data).__name__}, not an object")
    if data.get("format") != RUN_FORMAT:
        raise RunFormatError(f"not a saved gpuwidget run (format={data.get('format')!r})")
    _optional(data, "label", str, "text")
    _optional(data, "finished", bool, "true or false")
    for key in ("summary", "workload", "machine", "options", "sampler"):
        _optional(data, key, Mapping, "an object")
    findings = _optional(data, "findings", list, "a list")
    for i, finding in enumerate(findings or []):
        where = f"findings[{i}]"
        _expect(isinstance(finding, Mapping), where, "an object")
        for key in ("rule", "severity", "title"):
            _expect(isinstance(finding.get(key), str), f"{where}.{key}", "text")
        for key in ("evidence", "change"):
            _optional(finding, key, Mapping, "an object", where)
    for where, ranks in (("ranks", data.get("ranks")), ("workload.ranks", (data.get("workload") or {}).get("ranks"))):
        _check_ranks(ranks, where)
    error = data.get("error")
    if error is not None:
        _expect(isinstance(error, Mapping), "error", "an object or null")
        for key in ("type", "message"):
            _expect(isinstance(error.get(key), str), f"error.{key}", "text")
        _optional(error, "traceback", str, "text", "error")
    _expect("trace" in data, "trace", "a saved trace")
    check_trace(data["trace"])


def _check_ranks(ranks: Any, where: str) -> None:
    """``ranks``: absent, or a list of objects with a whole-number pid and numbers (or null) as figures."""
    if ranks is None:
        return
    _expect(isinstance(ranks, list), where, "a list")
    for i, entry in enumerate(ranks):
        at = f"{where}[{i}]"
        _expect(isinstance(entry, Mapping) and _count(entry.get("pid")), at, "an object with a pid")
        for key in ("rank", "gpu", "steps"):
            _expect(entry.get(key) is None or _count(entry[key]), f"{at}.{key}", "a whole number or null")
        for key in ("samples_per_s", "data_wait_fraction", "step_time_p50_s", "step_time_p95_s"):
            _expect(entry.get(key) is None or _finite(entry[key]), f"{at}.{key}", "a number or null")


def check_trace(data: Any) -> None:
    """Raise :class:`RunFormatError` unless ``data`` is a trace whose sizes agree with its contents."""
    where = "trace"
    _expect(isinstance(data, Mapping), where, "an object")
    if data.get("format") != TRACE_FORMAT:
        raise RunFormatError(f"trace: not a gpuwidget trace (format={data.get('format')!r})")
    _expect(_finite(data.get("start_wall")), "trace.start_wall", "a number")
    width = data.get("bucket_width_s")
    _expect(_finite(width) and width > 0, "trace.bucket_width_s", "a positive number")
    _expect(_count(data.get("rows_total")), "trace.rows_total", "a whole number >= 0")
    _optional(data, "meta", Mapping, "an object", where)
    t = data.get("t")
    _expect(isinstance(t, list) and all(_finite(v) for v in t), "trace.t", "a list of numbers")
    archive_rows = data.get("archive_rows")
    _expect(_count(archive_rows) and archive_rows <= len(t),
            "trace.archive_rows", f"a whole number between 0 and the {len(t)} rows the file holds")
    _numbers(data.get("archive_t_end"), archive_rows, "trace.archive_t_end", missing=False)
    mean = data.get("mean")
    _expect(isinstance(mean, Mapping), "trace.mean", "an object")
    for name, values in mean.items():
        _numbers(values, len(t), f"trace.mean[{name!r}]")
    for key in ("min", "max", "archive_count"):
        table = data.get(key)
        _expect(isinstance(table, Mapping) and set(table) == set(mean), f"trace.{key}",
                "an object with the same columns as trace.mean")
        for name, values in table.items():
            if key == "archive_count":
                _expect(isinstance(values, list) and len(values) == archive_rows
                        and all(_count(v) and v <= MAX_COUNT for v in values),
                        f"trace.archive_count[{name!r}]", f"{archive_rows} whole numbers")
            else:
                _numbers(values, archive_rows, f"trace.{key}[{name!r}]")
    stats = data.get("stats")
    _expect(isinstance(stats, Mapping) and set(stats) <= set(mean), "trace.stats",
            "an object over trace.mean's columns")
    for name, column in stats.items():
        at = f"trace.stats[{name!r}]"
        _expect(isinstance(column, Mapping), at, "an object")
        _expect(_count(column.get("count")) and column["count"] <= MAX_COUNT, f"{at}.count", "a whole number")
        _expect(_finite(column.get("total")), f"{at}.total", "a number")
        for key in ("min", "max", "last"):
            _expect(column.get(key) is None or _finite(column.get(key)), f"{at}.{key}", "a number or null")
    spans = data.get("spans")
    _expect(isinstance(spans, list), "trace.spans", "a list")
    for i, span in enumerate(spans):
        at = f"trace.spans[{i}]"
        _expect(isinstance(span, Mapping) and isinstance(span.get("kind"), str), at, "an object with a kind")
        _expect(_finite(span.get("start")) and _finite(span.get("end")), at, "numbers start and end")
        _optional(span, "attrs", Mapping, "an object", at)
    span_stats = data.get("span_stats")
    _expect(isinstance(span_stats, Mapping), "trace.span_stats", "an object")
    for kind, row in span_stats.items():
        _expect(isinstance(row, list) and len(row) == 4 and _finite(row[0]) and _finite(row[1])
                and all(v is None or _finite(v) for v in row[2:]),
                f"trace.span_stats[{kind!r}]", "[count, total, min, max]")


def _expect(condition: bool, where: str, what: str) -> None:
    if not condition:
        raise RunFormatError(f"not a saved gpuwidget run: {where} should be {what}")


def _optional(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str,
              where: str = "") -> Any:
    value = data.get(key)
    _expect(value is None or isinstance(value, kind), f"{where}.{key}" if where else key, f"{what} or null")
    return value


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _numbers(values: Any, length: int, where: str, missing: bool = True) -> None:
    """A list of exactly ``length`` numbers (null allowed where a value may be missing)."""
    _expect(isinstance(values, list) and len(values) == length
            and all(_finite(v) or (missing and v is None) for v in values),
            where, f"a list of {length} numbers")
