"""FittedTable: columns fold or are left out by priority, never squeezed to nothing."""

from __future__ import annotations

from io import StringIO

from rich.console import Console

from shoal.output import Col, FittedTable, Fold

COLUMNS = (
    Col("id", fold=Fold.NEVER),
    Col("name", min_width=12),
    Col("note", priority=3),
    Col("empty", priority=1),
    Col("metric", priority=1, fold=Fold.NEVER),
    Col("details", fold=Fold.FREELY, min_width=16),
)
ROW = ["a" * 32, "quickstart-20261203-101500", "optional note", "-", "0.1234", "some words " * 10]


def render(table: FittedTable, width: int) -> str:
    console = Console(width=width, file=StringIO())
    console.print(table)
    return console.file.getvalue()


def test_wide_enough_shows_everything_whole() -> None:
    text = render(FittedTable(COLUMNS, [ROW], "t"), 250)
    assert all(cell.strip() in text for cell in ROW) and "left out" not in text


def test_empty_then_optional_columns_go_before_anything_folds() -> None:
    table = FittedTable(COLUMNS, [ROW], "t", left_out_hint="--format json has all")
    width = 32 + 26 + 6 + 16 + 3 * 4 + 1  # id, name and metric whole, details at its floor
    assert table.shown(width) == [0, 1, 4, 5]
    text = render(table, width)
    assert "quickstart-20261203-101500" in text  # the name is whole: the note made room
    assert f"left out at {width} columns: note, empty (--format json has all)" in text


def test_narrow_folds_names_and_keeps_floors() -> None:
    table = FittedTable(COLUMNS, [ROW], "t")
    keep = table.shown(80)
    assert keep == [0, 1, 4, 5]
    widths = table.widths(keep, 80)
    assert widths[0] == 32 and widths[4] == 6  # never folded
    assert widths[1] >= 12 and widths[5] >= 16  # never under their floors
    assert sum(widths.values()) + 3 * len(keep) + 1 <= 80
    text = render(table, 80)
    assert "a" * 32 in text and "0.1234" in text and max(len(line) for line in text.splitlines()) <= 80


def test_important_columns_go_last_when_even_floors_do_not_fit() -> None:
    table = FittedTable(COLUMNS, [ROW], "t")
    assert table.shown(70) == [0, 1, 5]  # the metric (priority 1) goes, the priority-0 columns stay
    text = render(table, 70)
    assert "left out at 70 columns: note, empty, metric" in text


def test_short_titles_stay_on_one_line() -> None:
    text = render(FittedTable([Col("path", fold=Fold.FREELY)], [], "checkpoints"), 80)
    assert text.splitlines()[0].strip() == "checkpoints"
