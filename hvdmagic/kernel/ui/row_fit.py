"""How the dashboard's rank rows fit a narrow output area: which columns give way, and from what width.

A row is a line of fixed columns: the rank, the epoch, the bar's name and percentage, the bar,
the steps, the rate, elapsed<ETA, the state, the rank's CPU and memory (and GPUs), then its last
output line. In JupyterLab with a side panel open, or in a split view, the output area can be
600 px wide; the columns then do not fit, and what the row cuts off is its end: the state and
the figures a user looks at.

So the row is a CSS size container, and the columns give way whole, in this order, as the row
gets narrower: first the last output line shrinks (it ends in an ellipsis, whole in its title),
then the bar (to ``BAR_ROOM``), then the rate, then elapsed<ETA, then the bar's name, then the
epoch. The rank, the percentage, the steps, the state and the figures never do. The widths
come from the columns' characters, which the dashboard knows, at the monospace font's advance.
"""

from __future__ import annotations

from dataclasses import dataclass

from hvdmagic.kernel.ui import progress_text

CHAR_PX = 7.25  # a character of the rows' 12 px monospace fonts (DejaVu Sans Mono, Menlo, SF Mono: 7.2)
BAR_ROOM = 80  # px the bar keeps before the rate gives way; below the last break it shrinks to its 40 px
# Every px of a row that is not a column's text: the seven widgets' margins (4 px each, 8 px the steps'),
# the rule before the last line and its padding (7 px), and some slack for a font a little wider.
FRAME_PX = 6 * 4 + 8 + 7 + 8
STATE_PX = 70


@dataclass(frozen=True)
class Columns:
    """What a dashboard's rows hold now: the label's width (px), and the characters of the figures."""

    label_px: int
    epochs: bool
    usage_chars: int  # the widest row's straggler marker and figures, "CPU 98 % · 312 MB"


def breaks(columns: Columns) -> list[tuple[str, float]]:
    """(column, the row width in px below which it gives way), in the order they give way."""
    numbers = progress_text.left_width(columns.epochs) + progress_text.right_width(True) + columns.usage_chars
    width = columns.label_px + BAR_ROOM + STATE_PX + FRAME_PX + numbers * CHAR_PX
    order = [("rate", progress_text.RATE_WIDTH + 2), ("times", progress_text.TIMES_WIDTH),
             ("desc", progress_text.DESC_WIDTH + 1)]
    if columns.epochs:
        order.append(("epoch", progress_text.EPOCH_WIDTH + 2))
    found = []
    for name, chars in order:
        found.append((name, round(width)))
        width -= chars * CHAR_PX
    return found


def css(scope: str, columns: Columns) -> str:
    """The style that makes ``scope``'s rows (``.hvdmagic-rank``) give way: a container query a column."""
    rules = [f".{scope} .hvdmagic-rank {{ container-type: inline-size; }}",
             # The overall row's text: its widget's content box may shrink, so that its line ends in an ellipsis.
             f".{scope} .hvdmagic-overall-text .widget-html-content {{ min-width: 0; }}"]
    rules += [f"@container (max-width: {px}px) {{ .{scope} .hvdmagic-{name} {{ display: none; }} }}"
              for name, px in breaks(columns)]
    return "<style>" + "\n".join(rules) + "</style>"
