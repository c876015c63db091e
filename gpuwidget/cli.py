"""``gpuwatch``: watch a command (a training script, ``torchrun``) as ``%%gpuwatch`` watches a cell.

    gpuwatch [--interval S] [--gpus 0,1] [--view V] [--no-live] [--no-advice] [--tune] [--save PATH] \\
        [--quiet] [--price P] -- python train.py ARGS

The command runs inside the same :class:`~gpuwidget.session.Watch` as a watched cell: the same
options and checks, the same sampler and Run, the same rules; the watch's child channel reaches
the command's Python processes (and theirs: torchrun's workers) through the environment it
exports while it runs. A one-line status goes to stderr while the command runs, the panel's text
to stdout when it ends, and gpuwatch exits with the command's status (128 + N for a command
killed by signal N, as a shell reports it).

Signals: the command runs in a process group of its own. At a terminal that group is made the
terminal's foreground group for the command's lifetime (as a shell does for a job), so Ctrl-C,
Ctrl-\\ and terminal input reach the command exactly as if it were not watched; a SIGINT, SIGTERM
or SIGHUP sent to gpuwatch itself is passed on to the command's group. Either way the command
decides how to end, and the report is printed after it has. Ctrl-Z stops the command, and gpuwatch
with it, so the shell gets its prompt back; ``fg`` continues both.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, TextIO

from gpuwidget.options import OptionError, WatchOptions, parse_args, takes_value
from gpuwidget.probes import DATA_WAIT_SPAN, STEP_SPAN
from gpuwidget.report import run_text
from gpuwidget.run import Run
from gpuwidget.session import Watch

USAGE = """\
usage: gpuwatch [options] -- COMMAND [ARGS...]

Run COMMAND (a training script, torchrun ...) and report why its GPUs waited, as %%gpuwatch does
for a notebook cell. Exits with COMMAND's status.

options:
  --interval S   seconds between samples (default 0.25; 0.01 to 60)
  --gpus 0,1     GPUs to watch, numbered as torch numbers them (default: all visible)
  --view V       auto, bokeh or static: a status line while the command runs; none: no status line
  --no-live      the same as --view none
  --no-advice    summary figures only, no findings
  --tune         after the command, measure DataLoader settings (needs the loader in this process)
  --save PATH    also write the run to PATH (.json, .html or .csv)
  --quiet        print nothing; --save still writes the run
  --price P      what one GPU-hour costs: the report shows the run's cost and its idle share
                 (default: $GPUWIDGET_GPU_HOUR_PRICE)
  -h, --help     show this help"""

# A terminal gets its status line redrawn this often; a log (not a terminal) a line this often,
# the first one STATUS_FIRST_S in: enough to see the command is alive, not a line per second.
STATUS_REFRESH_S = 1.0
LOG_STATUS_EVERY_S = 10.0
STATUS_FIRST_S = 1.0
# How often the wait looks at the command (ended? stopped by Ctrl-Z?): quick enough to follow it at once.
POLL_S = 0.05
# Signals passed on to the command's process group when gpuwatch itself receives them.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# After this many forwarded interrupts the command's group is killed (a command that ignores them).
KILL_AFTER_INTERRUPTS = 3
# A shell's status for a command it could not find.
NOT_FOUND_STATUS = 127


class CommandExit(Exception):  # noqa: N818 - it is how the command ended, shown as such in the panel
    """The watched command ended with a non-zero status (recorded as the run's error)."""


def main(argv: Sequence[str] | None = None) -> int:
    """The ``gpuwatch`` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    try:
        option_args, command = split_command(args)
        options = parse_args(option_args, help_hint="see gpuwatch --help")
    except OptionError as exc:
        print(f"gpuwatch: {exc}", file=sys.stderr)
        return 2
    if not command:
        print("gpuwatch: no command given: gpuwatch [options] -- python train.py", file=sys.stderr)
        return 2
    if shutil.which(command[0]) is None:
        print(f"gpuwatch: command not found: {command[0]}", file=sys.stderr)
        return NOT_FOUND_STATUS
    watch = Watch(options, label=shlex.join(command), display=False)
    try:
        watch.start()
    except OptionError as exc:
        print(f"gpuwatch: {exc}", file=sys.stderr)
        return 2
    status, run = watch_command(command, watch, options)
    if not options.quiet:
        with contextlib.suppress(BrokenPipeError):  # `gpuwatch ... | head`: the reader left early
            print(run_text(run), flush=True)
        if options.save:
            print(f"gpuwatch: run saved to {options.save}", file=sys.stderr)
        if options.tune:
            print("gpuwatch --tune: the DataLoader lives in the command's process; tune it there with "
                  "gpuwidget.tune_loader(loader)", file=sys.stderr)
    return status


def split_command(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """gpuwatch's own options and the command: everything after ``--``, or from the first
    argument that is neither an option nor an option's value."""
    if "--" in args:
        index = args.index("--")
        return list(args[:index]), list(args[index + 1:])
    index = 0
    while index < len(args) and args[index].startswith("-"):
        wants_value = takes_value(args[index])
        if wants_value is None:
            raise OptionError(f"unknown option {args[index]!r} (see gpuwatch --help)")
        index += 2 if wants_value else 1
    return list(args[:index]), list(args[index:])


def watch_command(command: Sequence[str], watch: Watch, options: WatchOptions) -> tuple[int, Run]:
    """Run the command inside the started watch; its exit status and the finished Run."""
    run = watch.run
    assert run is not None, "watch_command() before watch.start()"
    process: subprocess.Popen[bytes] | None = None
    interrupts = 0

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupts
        if process is None or process.returncode is not None:
            return
        interrupts += signum == signal.SIGINT
        target = signal.SIGKILL if interrupts >= KILL_AFTER_INTERRUPTS else signum
        with contextlib.suppress(ProcessLookupError):  # the group has emptied meanwhile
            os.killpg(process.pid, target)

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED}
    terminal = None
    status = 1
    error: BaseException | None = None
    try:
        try:
            process = _start(command)
        except OSError as exc:  # not executable, a broken interpreter line
            print(f"gpuwatch: cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr)
            error, status = exc, 126
        else:
            terminal = _give_terminal(process.pid)
            # The status line is written from the background group then: a terminal with `stty tostop`
            # would stop gpuwatch for it (SIGTTOU); ignored, the write goes through.
            previous.setdefault(signal.SIGTTOU, signal.signal(signal.SIGTTOU, signal.SIG_IGN))
            status = _wait(process, run, options, terminal)
            error = _ending(status)
    finally:
        if terminal is not None:
            _take_terminal_back(terminal)
        try:
            finished = watch.finish(error)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    return status, finished


def _start(command: Sequence[str]) -> subprocess.Popen[bytes]:
    """The command in a process group of its own (its pid is the group's id)."""
    if sys.version_info >= (3, 11):
        return subprocess.Popen(list(command), process_group=0)
    return subprocess.Popen(list(command), preexec_fn=os.setpgrp)  # noqa: PLW1509 - setpgrp only


def _wait(process: subprocess.Popen[bytes], run: Run, options: WatchOptions, terminal: int | None) -> int:
    """Wait for the command, drawing the status line; its status as a shell gives it."""
    show = _status_writer(sys.stderr) if options.live and not options.quiet else None
    started = time.monotonic()
    last_line = -LOG_STATUS_EVERY_S
    next_look = started + STATUS_REFRESH_S
    try:
        while (code := _poll(process, terminal)) is None:
            if time.monotonic() >= next_look:
                next_look += STATUS_REFRESH_S
                elapsed = time.monotonic() - started
                due = show is not None and (show.live or elapsed - last_line >= LOG_STATUS_EVERY_S)
                if show is not None and due and elapsed >= STATUS_FIRST_S:
                    show(status_text(run, elapsed))
                    last_line = elapsed
            time.sleep(POLL_S)
    finally:
        if show is not None:
            show.close()
    return 128 - code if code < 0 else code


def _poll(process: subprocess.Popen[bytes], terminal: int | None) -> int | None:
    """The command's exit code (negative: the signal) once it has ended, else None. When the command
    stops at the terminal (Ctrl-Z), gpuwatch stops with it, as the shell's job it is, and when the
    shell continues the job it hands the terminal back (``fg``) and continues the command."""
    if process.returncode is not None:
        return process.returncode
    try:
        pid, status = os.waitpid(process.pid, os.WNOHANG | os.WUNTRACED)
    except ChildProcessError:  # reaped elsewhere: nothing more to learn
        process.returncode = 1
        return process.returncode
    if pid == 0:
        return None
    if os.WIFSTOPPED(status):
        if terminal is not None:
            _stop_with(process.pid, terminal)
        return None
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode


def _stop_with(group: int, fd: int) -> None:
    """Stop gpuwatch while the command is stopped; on continuing, continue the command too."""
    _take_terminal_back(fd)
    os.kill(os.getpid(), signal.SIGTSTP)  # here until the shell sends SIGCONT (fg or bg)
    with contextlib.suppress(OSError):
        if os.tcgetpgrp(fd) == os.getpgrp():  # fg gave the terminal back to us: pass it on
            _set_foreground(fd, group)
        os.killpg(group, signal.SIGCONT)


def _ending(status: int) -> BaseException | None:
    """How the command ended, as the run's error: None for success, KeyboardInterrupt for Ctrl-C."""
    if status == 0:
        return None
    if status == 128 + signal.SIGINT:
        return KeyboardInterrupt()
    if status > 128 and status - 128 in signal.valid_signals():
        return CommandExit(f"the command was killed by {signal.Signals(status - 128).name}")
    return CommandExit(f"the command exited with status {status}")


def status_text(run: Run, elapsed: float) -> str:
    """One line: time, steps and their rate, data wait, GPU and CPU use, from the live trace."""
    trace = run.trace
    parts = [f"gpuwatch {elapsed:.0f} s"]
    steps = trace.span_stats(STEP_SPAN)
    if steps is not None and steps.count:
        parts.append(f"{steps.count:,} steps ({steps.count / max(elapsed, 1e-9):.1f}/s)")
        waits = trace.span_stats(DATA_WAIT_SPAN)
        if waits is not None and steps.total > 0:
            parts.append(f"data wait {min(1.0, waits.total / steps.total):.0%}")
    last = trace.last()
    values = last[1] if last is not None else {}
    gpus = {column[3:-5]: value for column, value in values.items()
            if column.startswith("gpu") and column.endswith(".util") and column[3:-5].isdigit()}
    if gpus:
        parts.append("GPU " + " ".join(f"{gpus[index]:.0f}%" for index in sorted(gpus, key=int)))
    if "cpu.util" in values:
        parts.append(f"CPU {values['cpu.util']:.0f}%")
    return " · ".join(parts)


class _Status:
    """Writes status lines: redrawn in place on a terminal (rich where installed), one line per call otherwise."""

    def __init__(self, stream: TextIO, live: bool, redraw: Callable[[str], None] | None, stop: Callable[[], None]):
        self.stream = stream
        self.live = live
        self._redraw = redraw
        self._stop = stop

    def __call__(self, text: str) -> None:
        try:
            if self._redraw is not None:
                self._redraw(text)
            else:
                self.stream.write(text + "\n")
                self.stream.flush()
        except (OSError, ValueError):  # the terminal went away: the run goes on without a status
            pass

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._stop()


def _status_writer(stream: TextIO) -> _Status:
    if not _isatty(stream):
        return _Status(stream, False, None, lambda: None)
    try:
        from rich.console import Console
    except ImportError:
        def redraw(text: str) -> None:
            stream.write("\r\x1b[2K" + text)
            stream.flush()

        def stop() -> None:
            stream.write("\r\x1b[2K")
            stream.flush()

        return _Status(stream, True, redraw, stop)
    console = Console(file=stream)
    spinner: Any = console.status("gpuwatch: starting", spinner="dots", refresh_per_second=4)
    spinner.start()
    return _Status(stream, True, lambda text: spinner.update(text), spinner.stop)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _give_terminal(group: int) -> int | None:
    """Make the command's group the terminal's foreground group, as a shell does for a job; the
    terminal's descriptor, or None when gpuwatch is not in the foreground of a terminal."""
    try:
        fd = sys.stdin.fileno()
        if not os.isatty(fd) or os.tcgetpgrp(fd) != os.getpgrp():
            return None
        _set_foreground(fd, group)
        os.killpg(group, signal.SIGCONT)  # it may have stopped on reading the terminal before this
    except (OSError, ValueError, AttributeError):
        return None
    return fd


def _take_terminal_back(fd: int) -> None:
    with contextlib.suppress(OSError):
        _set_foreground(fd, os.getpgrp())


def _set_foreground(fd: int, group: int) -> None:
    # A process that is not in the foreground group gets SIGTTOU for tcsetpgrp: ignore it meanwhile.
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, group)
    finally:
        signal.signal(signal.SIGTTOU, previous)


if __name__ == "__main__":
    sys.exit(main())
