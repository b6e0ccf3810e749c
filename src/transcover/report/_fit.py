"""Printing a rich table so that no cell is cropped.

Note [uncropped tables]: rich measures a column's minimum as its longest word, but where the columns'
minimums add up to more than the console's width it shrinks every column anyway and crops each word
that no longer fits with an ellipsis: piped into a log (80 columns), ``lipschitz --data`` printed a
certified 3.481e+05 as ``3.481e+…`` and 7.571e+05 as ``7.571e…`` (red team 217).  :func:`print_table`
gives such a table the width it needs instead: the line is longer than the terminal, every number
stays whole.  Headers and prose cells still wrap at their spaces.
"""

from __future__ import annotations

__all__ = ["print_table"]


def print_table(console, table) -> None:
    """Print ``table`` on ``console`` with no cell cropped (Note [uncropped tables]).  Where the columns are too
    wide together, the widest are narrowed first, as rich does, but none below its longest word (its header's
    included; a ``no_wrap`` column not at all); a table still too wide is printed wider than the console rather
    than cut at its edge.  Columns with a fixed ``width`` are left alone."""
    from rich.measure import Measurement

    wide = console.options.update_width(1 << 16)
    free = [col for col in table.columns if col.width is None]
    lows, highs = [], []
    for col in free:
        sizes = [Measurement.get(console, wide, cell) for cell in (col.header, *col.cells)]
        highs.append(max([col.min_width or 0] + [m.maximum for m in sizes]))
        lows.append(highs[-1] if col.no_wrap else max([col.min_width or 0] + [m.minimum for m in sizes]))
    # borders and padding: the table's widest rendering less its columns' widest cells
    room = console.width - (Measurement.get(console, wide, table).maximum - sum(highs))
    if table.collapse_padding and table.pad_edge and free and free[0] is table.columns[0]:
        # rich counts one padding for a collapsed first column but draws both: its text has one space less
        lows[0], highs[0] = lows[0] + table.padding[3], highs[0] + table.padding[3]
    widths = list(highs)
    while sum(widths) > room and any(w > lo for w, lo in zip(widths, lows)):
        top = max(w for w, lo in zip(widths, lows) if w > lo)
        for k in range(len(widths)):
            if widths[k] == top and widths[k] > lows[k] and sum(widths) > room:
                widths[k] -= 1
    if widths != highs:  # rich's own narrowing ignores the longest words: the widths are fixed here instead
        for col, w in zip(free, widths):  # not ``width``: rich shrinks a fixed width with the rest, not a clamp
            col.min_width = col.max_width = w
    console.print(table, crop=False)
