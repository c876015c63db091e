"""Options of a watch, shared by ``%%gpuwatch`` and ``gpuwidget.watch()``, validated up front."""

from __future__ import annotations

import argparse
import math
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypedDict, cast

from gpuwidget.runfile import save_target, unwritable_reason

# 4 Hz matches the live plot's refresh and NVML's own utilisation window (1/6 s to
# 1 s depending on the GPU), so faster polling mostly repeats values; the sampler's
# cost at this rate is measured in BENCHMARKS.md.
DEFAULT_INTERVAL_S = 0.25
MIN_INTERVAL_S = 0.01
MAX_INTERVAL_S = 60.0
SAVE_SUFFIXES = (".json", ".html", ".htm", ".csv")
# The live view under a running cell: chosen by where the kernel runs (auto), the Bokeh widget
# (JupyterLab, Notebook), a widget-free SVG updated in place (VS Code, Colab), or none.
VIEWS = ("auto", "bokeh", "static", "none")
# The price of one GPU-hour when neither --price nor watch(price=...) gives one: the Jupyter server's
# ``GpuWidget.gpu_hour_price`` sets it for the kernels it starts (they inherit its environment), and a
# user may set it in theirs. In whatever currency the user thinks in; the report shows the number.
PRICE_ENV = "GPUWIDGET_GPU_HOUR_PRICE"
# --budget: the seconds --tune and the panel's Measure take, instead of what the plan announces. Unset,
# this variable's value where set: the Jupyter server's ``GpuWidget.measure_budget`` sets it for the
# kernels it starts, as it does the price.
BUDGET_ENV = "GPUWIDGET_MEASURE_BUDGET"
MIN_BUDGET_S = 1.0
MAX_BUDGET_S = 3600.0


class OptionError(ValueError):
    """A bad watch option; the message is one line meant for the user."""


class SavedOptions(TypedDict, total=False):
    """:class:`WatchOptions` as a saved run keeps them (``gpus`` a list); a run saved by an older version
    may lack the options added since."""

    interval: float
    gpus: list[int] | None
    live: bool
    view: str
    advice: bool
    tune: bool
    save: str | None
    quiet: bool
    price: float | None
    budget: float | None


@dataclass(frozen=True)
class WatchOptions:
    """What to watch and show. Construct through :func:`make_options` or :func:`parse_line`.

    ``live`` is ``view != "none"`` (kept for callers and saved runs from before ``view``):
    either ``live=False`` or ``view="none"`` turns the live view off.
    """

    interval: float = DEFAULT_INTERVAL_S
    gpus: tuple[int, ...] | None = None
    live: bool = True
    view: str = "auto"
    advice: bool = True
    tune: bool = False
    save: str | None = None
    quiet: bool = False
    price: float | None = None  # per GPU-hour: the summary's cost and idle_cost
    budget: float | None = None  # seconds for --tune and Measure (None: what measure.plan.plan_budget announces)

    def __post_init__(self) -> None:
        if not self.live:
            object.__setattr__(self, "view", "none")
        elif self.view == "none":
            object.__setattr__(self, "live", False)

    def to_dict(self) -> SavedOptions:
        data = asdict(self)
        data["gpus"] = None if self.gpus is None else list(self.gpus)
        return cast(SavedOptions, data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WatchOptions:
        """The options :meth:`to_dict` wrote (a saved run's); keys this version does not know are left out."""
        known = {option.name for option in fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        if values.get("gpus") is not None:
            values["gpus"] = tuple(values["gpus"])
        return cls(**values)


def make_options(interval: float | str = DEFAULT_INTERVAL_S, gpus: Sequence[int] | str | None = None,
                 live: bool = True, advice: bool = True, tune: bool = False,
                 save: str | Path | None = None, quiet: bool = False, view: str = "auto",
                 price: float | str | None = None, budget: float | str | None = None) -> WatchOptions:
    """Validate and normalise options; raises :class:`OptionError` with a one-line reason.

    ``price`` (per GPU-hour) defaults to :data:`PRICE_ENV` in the environment, where set. ``budget``:
    the seconds ``--tune`` and the panel's Measure button take (their default, what they announce), and
    defaults to :data:`BUDGET_ENV`, where set.
    """
    return WatchOptions(
        budget=_budget(budget),
        price=_price(price),
        interval=_interval(interval),
        gpus=_gpus(gpus),
        live=_flag("live", live),
        view=_view(view, live),
        advice=_flag("advice", advice),
        tune=_flag("tune", tune),
        save=_save(save),
        quiet=_flag("quiet", quiet),
    )


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptionError(f"{name}: expected True or False, got {value!r}")
    return value


def _view(value: Any, live: Any) -> str:
    """``--view``; ``--no-live`` (live=False) is ``--view none`` and contradicts any other view."""
    if not isinstance(value, str) or value not in VIEWS:
        raise OptionError(f"--view: expected one of {', '.join(VIEWS)}, got {value!r}")
    if live is False and value not in ("auto", "none"):
        raise OptionError(f"--no-live means --view none, which contradicts --view {value}")
    return "none" if live is False else value


def _interval(value: float | str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"--interval: expected a number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds < MIN_INTERVAL_S or seconds > MAX_INTERVAL_S:
        raise OptionError(
            f"--interval: must be between {MIN_INTERVAL_S} and {MAX_INTERVAL_S:g} seconds, got {value!r}"
        )
    return seconds


def _gpus(value: Sequence[int] | str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    items: Sequence[Any]
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",")]
    elif isinstance(value, int):
        items = [value]
    else:
        items = list(value)
    out: list[int] = []
    for item in items:
        if isinstance(item, str) and item.isascii() and item.isdigit():
            index = int(item)
        elif isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            index = item
        else:
            raise OptionError(f"--gpus: expected GPU numbers like 0,1, got {value!r}")
        if index not in out:
            out.append(index)
    if not out:
        raise OptionError("--gpus: give at least one GPU number, like 0 or 0,1")
    return tuple(out)


def _number(value: object) -> float:
    """``value`` as a float, NaN where it is none (a bool, text that is no number): the checks then fail."""
    try:
        return float(value) if not isinstance(value, bool) else math.nan  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def _or_environment(value: float | str | None, option: str, variable: str,
                    what: str) -> tuple[float | str | None, str]:
    """(the option's value, else ``variable``'s where set, else None; what an error should name)."""
    if value is not None:
        return value, option
    value = os.environ.get(variable) or None
    return value, f"{variable} (the environment's {what})"


def _price(value: float | str | None) -> float | None:
    """``--price``: a positive, finite number per GPU-hour; unset, :data:`PRICE_ENV`'s value (or none)."""
    value, where = _or_environment(value, "--price", PRICE_ENV, "GPU-hour price")
    if value is None:
        return None
    price = _number(value)
    if not math.isfinite(price) or price <= 0:
        raise OptionError(f"{where}: expected a positive price per GPU-hour like 2.5, got {value!r}")
    return price


def _budget(value: float | str | None) -> float | None:
    """``--budget``: seconds, :data:`MIN_BUDGET_S` to :data:`MAX_BUDGET_S`; unset, :data:`BUDGET_ENV`'s value
    (or None: the plan's own)."""
    value, where = _or_environment(value, "--budget", BUDGET_ENV, "Measure budget")
    if value is None:
        return None
    seconds = _number(value)
    if not MIN_BUDGET_S <= seconds <= MAX_BUDGET_S:  # (NaN fails both)
        raise OptionError(f"{where}: expected seconds from {MIN_BUDGET_S:g} to {MAX_BUDGET_S:g}, got {value!r}")
    return seconds


def _save(value: str | Path | None) -> str | None:
    """The file to save to, checked now: a bad path is reported before the cell runs, not after it."""
    if value is None:
        return None
    path = save_target(value)
    if path.suffix.lower() not in SAVE_SUFFIXES:
        raise OptionError(f"--save: use a .json, .html or .csv file name, got {str(value)!r}")
    reason = unwritable_reason(path)
    if reason is not None:
        raise OptionError(f"--save: cannot save to {str(value)!r}: {reason}")
    return str(path)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print usage and exit
        raise OptionError(message)


def _parser() -> _Parser:
    parser = _Parser(prog="%%gpuwatch", add_help=False, allow_abbrev=False)
    parser.add_argument("--interval", default=str(DEFAULT_INTERVAL_S))
    parser.add_argument("--gpus", default=None)
    parser.add_argument("--view", default="auto")
    parser.add_argument("--no-live", dest="live", action="store_false")
    parser.add_argument("--no-advice", dest="advice", action="store_false")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--save", default=None)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--price", default=None)
    parser.add_argument("--budget", default=None)
    return parser


def parse_line(line: str) -> WatchOptions:
    """Parse the ``%%gpuwatch`` line; raises :class:`OptionError` with a one-line reason."""
    try:
        argv = shlex.split(line)
    except ValueError as exc:
        raise OptionError(f"cannot parse options: {exc}") from None
    return parse_args(argv)


def parse_args(argv: Sequence[str], help_hint: str = "see %%gpuwatch? for the options") -> WatchOptions:
    """Parse options given as separate arguments (``%%gpuwatch``'s line, split; the ``gpuwatch``
    command's own arguments): the same checks and one-line errors."""
    namespace, extra = _parser().parse_known_args(list(argv))
    if extra:
        raise OptionError(f"unknown option {extra[0]!r} ({help_hint})")
    return make_options(**vars(namespace))


def takes_value(option: str) -> bool | None:
    """Whether a watch option (``--save``) is followed by a value; None for a token that is not one."""
    action = _parser()._option_string_actions.get(option.split("=", 1)[0])
    if action is None:
        return None
    return action.nargs != 0 and "=" not in option
