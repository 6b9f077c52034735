"""What shoal prints: tables that stay readable at any width, piped output included
(off a terminal rich assumes 80 columns), and the same data as JSON for scripts.

A table that is too wide first leaves out its optional columns, then folds its
text, then leaves out important columns; the caption names what was left out.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from rich.console import Console, ConsoleOptions, JustifyMethod, RenderResult
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from shoal.redact import redact

BORDER = 3  # each column's padding (1 + 1) and its left border, in the default box
OPTIONAL = 3  # columns of this priority or higher go before any column folds
EMPTY = ("", "-")
SHORT_TITLE = 24  # a table is made as wide as a title this short, so that it stays on one line


class RedactingConsole(Console):
    """A rich Console that masks the credentials of any URI in the text it prints: strings
    before they are laid out (a URI folded over two lines is no longer one match), and
    whatever renderables (tables) produce, as it is written."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        super().print(*(redact(o) if isinstance(o, str) else o for o in objects), **kwargs)

    def out(self, *objects: Any, **kwargs: Any) -> None:
        super().out(*(redact(o) if isinstance(o, str) else o for o in objects), **kwargs)

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return redact(super()._render_buffer(buffer))


class Fold(StrEnum):
    NEVER = "never"  # always whole: times, numbers, statuses
    LAST = "last"  # whole while optional columns can make room: ids, names
    FREELY = "freely"  # long text: folds down to min_width before anything is left out


@dataclass(frozen=True)
class Col:
    """One column. `priority` 0 is always shown; when the table is too wide, columns
    with no values go first, then the highest priority numbers (the last first)."""

    header: str
    priority: int = 0
    fold: Fold = Fold.LAST
    min_width: int = 10  # a folding column is never made narrower than this
    justify: JustifyMethod = "left"
    style: str | None = None


def cell_width(cell: str) -> int:
    """The widest line of a cell (rich markup) in terminal columns."""
    return max((line.cell_len for line in Text.from_markup(cell).split()), default=0)


class FittedTable:
    """A rich renderable: the table that fits the width it is printed at."""

    def __init__(
        self,
        columns: Sequence[Col],
        rows: Iterable[Sequence[str]],
        title: str | None = None,
        show_header: bool = True,
        left_out_hint: str = "",
    ):
        self.columns, self.rows = list(columns), [list(r) for r in rows]
        self.title, self.show_header, self.left_out_hint = title, show_header, left_out_hint
        cells = ([[c.header for c in self.columns]] if show_header else []) + self.rows
        self.natural = [max((cell_width(r[i]) for r in cells), default=1) for i in range(len(self.columns))]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.table(options.max_width)

    def _floor(self, i: int) -> int:
        column = self.columns[i]
        return self.natural[i] if column.fold == Fold.NEVER else min(self.natural[i], column.min_width)

    def _roomy(self, i: int) -> int:
        return self._floor(i) if self.columns[i].fold == Fold.FREELY else self.natural[i]

    def _is_empty(self, i: int) -> bool:
        return bool(self.rows) and all(row[i].strip() in EMPTY for row in self.rows)

    def shown(self, width: int) -> list[int]:
        """The columns that fit in `width`, in their order."""
        keep = list(range(len(self.columns)))
        droppable = sorted(
            (i for i in keep if self.columns[i].priority > 0),
            key=lambda i: (self._is_empty(i), self.columns[i].priority, i),
        )

        def needs(size: Any) -> int:
            return sum(size(i) + BORDER for i in keep) + 1

        while droppable and needs(self._roomy) > width and self._is_optional(droppable[-1]):
            keep.remove(droppable.pop())
        while droppable and needs(self._floor) > width:
            keep.remove(droppable.pop())
        return keep

    def _is_optional(self, i: int) -> bool:
        return self._is_empty(i) or self.columns[i].priority >= OPTIONAL

    def widths(self, keep: list[int], width: int) -> dict[int, int]:
        """Fixed widths where the natural ones do not fit (none where they do): every
        column its floor, then the room left to LAST columns, then to FREELY ones,
        the least short of room first."""
        room = width - 1 - BORDER * len(keep)
        if sum(self.natural[i] for i in keep) <= room:
            return {}
        widths = {i: self._floor(i) for i in keep}
        spare = room - sum(widths.values())
        if spare < 0:
            return {}  # even the floors do not fit: rich squeezes what is left
        for fold in (Fold.LAST, Fold.FREELY):
            wanting = [i for i in keep if self.columns[i].fold == fold and self.natural[i] > widths[i]]
            wanting.sort(key=lambda i: self.natural[i] - widths[i])
            for position, i in enumerate(wanting):
                share = min(self.natural[i] - widths[i], spare // (len(wanting) - position))
                widths[i] += share
                spare -= share
        return widths

    def table(self, width: int) -> Table:
        keep = self.shown(width)
        left_out = [c.header for i, c in enumerate(self.columns) if i not in keep]
        caption = None
        if left_out:
            hint = f" ({self.left_out_hint})" if self.left_out_hint else ""
            caption = f"left out at {width} columns: {', '.join(left_out)}{hint}"
        table = Table(
            title=self.title,
            title_justify="left",
            show_header=self.show_header,
            caption=caption,
            caption_justify="left",
            min_width=min(width, cell_width(self.title or ""), SHORT_TITLE),
        )
        widths = self.widths(keep, width)
        for i in keep:
            column = self.columns[i]
            table.add_column(
                column.header,
                justify=column.justify,
                style=column.style,
                no_wrap=column.fold == Fold.NEVER,
                overflow="fold",
                width=widths.get(i),
            )
        for row in self.rows:
            table.add_row(*[row[i] for i in keep])
        return table


def local_time(millis: int | None) -> str:
    """An epoch time in milliseconds as people read it here; '-' for none."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(millis / 1000)) if millis else "-"


def iso_time(millis: int | None) -> str | None:
    """An epoch time in milliseconds as ISO 8601 with its UTC offset, for scripts."""
    return (
        datetime.fromtimestamp(millis / 1000).astimezone().isoformat(timespec="seconds") if millis else None
    )


def print_json(console: Console, data: Any) -> None:
    """`data` as JSON, alone on the console's output (no markup, wrapping or colour)."""
    console.out(json.dumps(data, indent=2, default=str), highlight=False)
