"""`python -m benchmarks --write FILE` updates the table of an existing file: the rows measured replace theirs, the
other rows and everything after the table stay (docs/benchmarks.md's notes and sections were once lost to it)."""

from __future__ import annotations

import pytest

from benchmarks.harness import TABLE_HEAD, Row, to_markdown, write_table


def _row(area: str, name: str, ratio: float, model: str = "M") -> Row:
    return Row(area, name, ratio, 1.1, f"detail of {name}", model)


def test_a_new_file_gets_a_title_and_the_table(tmp_path):
    path = tmp_path / "bench.md"
    write_table(path, [_row("detect", "a / b", 0.9)], "Header.")
    assert path.read_text() == "# Benchmarks\n\n" + to_markdown([_row("detect", "a / b", 0.9)], "Header.")


def test_an_update_replaces_the_rows_measured_and_keeps_the_rest(tmp_path):
    path = tmp_path / "bench.md"
    before = [_row("detect", "a / b", 0.9), _row("origin", "c / d", 1.2), _row("origin", "c / d", 1.3, model="N")]
    notes = "\nNotes:\n\n- a note that no run writes\n\n## Issue 1\n\n| a table | of its own |\n|---|---|\n| x | y |\n"
    path.write_text("# Benchmarks\n\n" + to_markdown(before, "Old header.") + notes)

    write_table(path, [_row("origin", "c / d", 1.05), _row("attention", "e / f", 0.8)], "New header.")

    text = path.read_text()
    assert text.startswith("# Benchmarks\n\nNew header.\n\n" + TABLE_HEAD + "\n")
    assert "Old header." not in text
    assert text.endswith(notes)  # everything after the table, as it was
    table = text[text.index(TABLE_HEAD):text.index("\nNotes:")].splitlines()[2:]
    assert [line.split(" | ")[3] for line in table] == ["0.90", "1.05", "1.30", "0.80"]  # replaced in place, added last
    assert [line.split(" | ")[0] for line in table] == ["| M", "| M", "| N", "| M"]


def test_a_file_without_a_table_is_left_alone(tmp_path):
    path = tmp_path / "notes.md"
    path.write_text("# Something else\n")
    with pytest.raises(SystemExit, match="no benchmark table"):
        write_table(path, [_row("detect", "a / b", 0.9)], "Header.")
    assert path.read_text() == "# Something else\n"
