"""Bring a DataTable to a new list of rows with as little work as possible.

Same keys in the same order (the common case: a refresh where only numbers moved): only the changed
cells are written. Otherwise the table is rebuilt and the cursor stays on the row it was on (by key).
Keeping the cursor still matters: a table that jumps to its first row every second cannot be read.
"""

from __future__ import annotations

from collections.abc import Sequence

from textual.widgets import DataTable

Row = tuple[str, Sequence[object]]  # (row key, cells)


def sync_rows(table: DataTable, rows: Sequence[Row]) -> bool:
    """Make ``table`` show ``rows``. Returns True when it had to rebuild."""
    current = [k.value for k in table.rows]
    wanted = [key for key, _ in rows]
    columns = list(table.columns)
    if current == wanted:
        for key, cells in rows:
            old = table.get_row(key)
            for col, before, after in zip(columns, old, cells, strict=False):
                if before != after:
                    table.update_cell(key, col, after, update_width=True)
        return False
    cursor_key = (
        current[table.cursor_row] if table.row_count and 0 <= table.cursor_row < len(current) else None
    )
    table.clear()
    for key, cells in rows:
        table.add_row(*cells, key=key)
    if cursor_key is not None and cursor_key in wanted:
        table.move_cursor(row=table.get_row_index(cursor_key), scroll=False)
    return True
