"""What ``hetfed run`` shows a person: a progress bar per run while it federates, then one table (rich).

On a terminal the bars redraw in place; elsewhere (logs, CI, a pipe) each run prints a line only when its
round changes, and the table is plain text wide enough not to wrap.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import TracebackType

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from hetfed.wire.messages import RunStatus
from hetfed.wire.phases import Phase


def _console() -> Console:
    tty = sys.stdout.isatty()
    # Off a terminal rich would assume 80 columns and wrap the table: give it room instead.
    return Console(highlight=False, soft_wrap=not tty, width=None if tty else 160)


def say(text: str) -> None:
    """Print one line as the rest of the command's output does."""
    _console().print(text, markup=False)


def _done(status: RunStatus) -> int:
    if status.phase in (Phase.EVALUATE, Phase.FINISHED):
        return status.total_rounds
    return min(status.total_rounds, max(0, status.round - 1))


def _accuracy(status: RunStatus) -> str:
    """The last round's accuracy over the organizations that showed it; those that withheld it (docs/privacy.md)
    are left out and counted, and a round where all withheld it shows "acc withheld"."""
    for rec in reversed(status.history):
        if not rec.reports:
            continue
        withheld = sum(m.is_withheld("test_accuracy") or m.is_withheld("num_test_examples")
                       for m in rec.reports.values())
        if withheld == len(rec.reports):
            return "acc withheld"
        shown = [m for m in rec.reports.values()
                 if not (m.is_withheld("test_accuracy") or m.is_withheld("num_test_examples"))]
        n = sum(m.num_test_examples for m in shown)
        if n:
            acc = sum(m.test_accuracy * m.num_test_examples for m in shown) / n
            return f"acc {100 * acc:5.1f}%" + (f" ({withheld} withheld)" if withheld else "")
    return ""


class Progress:
    """One bar per run, updated from each Status poll."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.tty = sys.stdout.isatty()
        self._bars: RichProgress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._last: dict[str, tuple[int, Phase]] = {}

    def __enter__(self) -> Progress:
        if not self.quiet and self.tty:
            self._bars = RichProgress(
                TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[state]:<9} {task.fields[acc]}"), TimeElapsedColumn(),
                console=_console(),
            )
            self._bars.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bars is not None:
            self._bars.stop()

    def note(self, text: str) -> None:
        """Print one line (above the bars on a terminal)."""
        if self.quiet:
            return
        if self._bars is not None:
            self._bars.console.print(text, markup=False, highlight=False)
        else:
            say(text)

    def update(self, runs: Sequence[RunStatus]) -> None:
        """Show the runs' progress."""
        if self.quiet:
            return
        for s in runs:
            state = s.phase.value
            if self._bars is not None:
                if s.run_id not in self._tasks:
                    self._tasks[s.run_id] = self._bars.add_task(s.algorithm, total=s.total_rounds, state=state, acc="")
                self._bars.update(self._tasks[s.run_id], completed=_done(s), state=state, acc=_accuracy(s))
            elif self._last.get(s.run_id) != (_done(s), s.phase):
                self._last[s.run_id] = (_done(s), s.phase)
                say(f"{s.algorithm:<12} {_done(s):>4}/{s.total_rounds} rounds  {state:<9} {_accuracy(s)}")


def print_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """The final table."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for h in head:
        table.add_column(h, no_wrap=True)
    for row in rows:
        table.add_row(*row)
    _console().print(table)
