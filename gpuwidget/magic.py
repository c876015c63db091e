"""The ``%%gpuwatch`` cell magic: parse options, then run the cell exactly as if unwatched.

The cell body is compiled and executed here (as IPython's own ``%%time`` does) rather than
through ``shell.run_cell``, which would swallow the cell's exception: the user's exception
propagates unchanged and its traceback is shown once, by IPython, pointing at the cell's
own lines. Assignments land in the user namespace and the last expression's value is the
magic's return value, so IPython displays it as the cell's ``Out``.
"""

from __future__ import annotations

import ast
from typing import Any

from IPython.core.displayhook import DisplayHook
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class

from gpuwidget.options import OptionError, parse_line
from gpuwidget.session import Watch, cell_key, running_cell_id


@magics_class
class GpuWatchMagics(Magics):
    """Registers ``%%gpuwatch``."""

    @cell_magic
    def gpuwatch(self, line: str, cell: str) -> Any:
        """%%gpuwatch [--interval S] [--gpus 0,1] [--view V] [--no-live] [--no-advice] [--tune] [--budget S]
                   [--save PATH] [--quiet] [--price P]

        Watch the GPU(s), the host and the workload while the cell runs: a live plot
        under the cell, and when it ends a summary of where the time went. The cell
        behaves as if it were not watched: names it assigns stay, its last expression is
        displayed and its exception propagates unchanged. See gpuwidget.last_run().

        Options:
          --interval S   seconds between samples (default 0.25; 0.01 to 60)
          --gpus 0,1     GPUs to watch, numbered as torch numbers them (default: all visible)
          --view V       the live view: bokeh (interactive plot), static (a chart redrawn
                         every second, for front-ends without widgets: VS Code, Colab),
                         none, or auto (default: static in VS Code and Colab, else bokeh)
          --no-live      no live plot while the cell runs (same as --view none)
          --no-advice    summary figures only, no findings
          --tune         after the cell, measure its loader's settings (at most 20 s) and every
                         finding's change in its own training step (15 s each, then together)
          --budget S     the seconds --tune and the panel's Measure take in all, instead of what
                         they announce (1 to 3600; shorter: fewer repeats, wider intervals)
          --save PATH    also write the run to PATH (.json, .html or .csv)
          --quiet        show nothing; the run is still recorded
          --price P      what one GPU-hour costs (any currency): the report shows the cell's cost
                         and its idle share (default: $GPUWIDGET_GPU_HOUR_PRICE, which the Jupyter
                         server's GpuWidget.gpu_hour_price sets for its kernels)
        """
        __tracebackhide__ = True  # IPython hides this frame: the traceback shows the cell only
        try:
            options = parse_line(line)
        except OptionError as exc:
            raise UsageError(f"%%gpuwatch: {exc}") from None
        code, last_expr = self._compile(line, cell)
        session = Watch(options, label=_label(self.shell), namespace=self.shell.user_ns,  # type: ignore[union-attr]
                        source=cell_key(running_cell_id()))
        try:
            session.start()
        except OptionError as exc:
            raise UsageError(f"%%gpuwatch: {exc}") from None
        shell: Any = self.shell
        try:
            exec(code, shell.user_global_ns, shell.user_ns)
            value = eval(last_expr, shell.user_global_ns, shell.user_ns) if last_expr is not None else None
        except BaseException as exc:
            session.finish(exc)
            raise
        session.finish(None)
        return value

    def _compile(self, line: str, cell: str) -> tuple[Any, Any]:
        """Compile the body with IPython's transforms, keeping the cell's line numbers."""
        shell: Any = self.shell
        transformed = shell.transform_cell(cell)
        # Register the source so tracebacks show the user's lines, numbered as in the cell.
        header = f"%%gpuwatch {line}".rstrip() + "\n"
        filename = shell.compile.cache(header + transformed, _cell_number(shell), raw_code=header + cell)
        tree = shell.compile.ast_parse(transformed, filename=filename)
        ast.increment_lineno(tree, 1)
        tree = shell.transform_ast(tree)
        last_expr = None
        # A trailing ';' suppresses the value, as in an unwatched cell.
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(transformed):
            last_expr = shell.compile(ast.Expression(tree.body.pop().value), filename, "eval")
        return shell.compile(tree, filename, "exec"), last_expr


def check_cell_syntax(lines: list[str]) -> list[str]:
    """IPython input transformer (cleanup stage): a ``%%gpuwatch`` cell whose body does not
    parse raises its SyntaxError while IPython prepares the cell, before anything runs.

    IPython then shows it as for any cell (``Cell In[5], line 3`` and the caret, no traceback
    through the magic) and counts it as an error before execution; raised from inside the
    magic, the traceback would run through IPython's and gpuwidget's frames. ``lines`` are
    returned unchanged otherwise.
    """
    if not lines or not lines[0].startswith("%%gpuwatch"):
        return lines
    from IPython import get_ipython

    shell: Any = get_ipython()
    if shell is None:
        return lines
    transformed = shell.transform_cell("".join(lines[1:]))
    # Named and cached as the magic will (header line first), so IPython finds its lines.
    filename = shell.compile.cache(lines[0] + transformed, shell.execution_count, raw_code="".join(lines))
    # One blank line in place of the magic's: the error's line number is the cell's.
    shell.compile.ast_parse("\n" + transformed, filename=filename)
    return lines


# It caches the cell's source: IPython skips it when only asked whether a cell is complete
# (a console typing a %%gpuwatch cell), where an unfinished body is not yet an error.
check_cell_syntax.has_side_effects = True  # type: ignore[attr-defined]


def _cell_number(shell: Any) -> int:
    """The running cell's number: IPython counts it up before running a cell it stores."""
    info = getattr(shell, "_gpuwidget_cell_info", None)
    count = int(getattr(shell, "execution_count", 0) or 0)
    return count - 1 if info is not None and info.store_history else count


def record_cell_info(shell: Any, info: Any) -> None:
    """``pre_run_cell`` hook: remember whether the running cell counts in the history."""
    shell._gpuwidget_cell_info = info


def _label(shell: Any) -> str:
    return f"In [{_cell_number(shell)}]"


def _ends_with_semicolon(source: str) -> bool:
    return bool(DisplayHook.semicolon_at_end_of_expression(source))
