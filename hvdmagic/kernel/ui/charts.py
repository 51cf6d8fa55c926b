"""Inline SVG charts of metric series, for the live dashboard and the saved snapshot.

Pure functions of numbers to HTML, standard library only. The charts follow
TensorBoard's conventions: a debiased exponential moving average drawn solid
over the faint raw line, a log scale when a metric spans decades, and the
latest value in each chart's header. Hovering a chart shows a point's step and
value through SVG ``<title>`` elements on invisible bands, so the charts need no
JavaScript and keep working in a saved notebook.

A logged NaN or inf is shown as the latest value but never plotted. Series are
downsampled to ``CHART_POINTS`` points for display, always keeping the last one;
the run's record keeps every value.

The chart wrapper sets ``font-size:0``: a sanitizer that strips ``<svg>`` but
keeps its text (JupyterLab's, for an untrusted notebook) then leaves an empty
box instead of a pile of tick labels and tooltips. The SVG sets its own sizes.
"""

from __future__ import annotations

import html
import math
from bisect import bisect_left
from collections.abc import Sequence

CHART_POINTS = 300  # per series on screen; the record keeps the full history
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
SCALES = ("auto", "linear", "log")
LOG_DECADES = 2  # "auto" picks a log scale when the values span at least this many decades

Series = tuple[str, Sequence[float], Sequence[float]]  # (label, steps, values)

_FONT = "-apple-system,BlinkMacSystemFont,'Segoe UI',Helvetica,Arial,sans-serif"
_GRID = "#ececec"
_AXIS = "#bbb"
_MUTED = "#777"


# -- numbers -----------------------------------------------------------------

def value_label(value: float) -> str:
    """A value as the charts print it: 4 significant digits, ``nan``/``inf`` as such."""
    return f"{value:.4g}"


def step_label(step: float) -> str:
    return str(int(step)) if math.isfinite(step) and float(step).is_integer() else f"{step:.6g}"


def _hover_value(value: float) -> str:
    return f"{value:.6g}"


def _si(value: float) -> str:
    """An axis label for steps: 1500 -> 1.5k."""
    magnitude = abs(value)
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if magnitude >= limit:
            return f"{value / limit:.3g}{suffix}"
    return step_label(value)


def _tick_label(value: float, spacing: float) -> str:
    """A linear tick label, with as many decimals as the tick spacing needs."""
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1e5 or magnitude < 1e-3:
        text = f"{value:.2e}".replace(".00e", "e")
        mantissa, exponent = text.split("e")
        mantissa = mantissa.rstrip("0").rstrip(".") if "." in mantissa else mantissa
        return f"{mantissa}e{int(exponent)}"
    decimals = max(0, -math.floor(math.log10(spacing) + 1e-9)) if spacing > 0 else 0
    return f"{value:.{decimals}f}"


def _power_label(exponent: int) -> str:
    """10**exponent as a tick label: 0.01, 1, 100 within three decades of 1, else 1e-5, 1e6."""
    if -3 <= exponent < 0:
        return f"{10.0 ** exponent:.{-exponent}f}"
    if 0 <= exponent <= 3:
        return str(10**exponent)
    return f"1e{exponent}"


def _log_tick_label(value: float) -> str:
    exponent = round(math.log10(value))
    if math.isclose(value, 10.0**exponent, rel_tol=1e-9):
        return _power_label(exponent)
    return f"{value:.3g}"


def _nice_ticks(lo: float, hi: float, count: int = 4, whole: bool = False) -> tuple[list[float], float]:
    """Round ticks (1, 2 or 5 times a power of ten apart) inside [lo, hi], and their spacing;
    ``whole``: at least 1 apart (integer steps)."""
    span = hi - lo
    if not span > 0:
        return [lo], 0.0
    magnitude = 10.0 ** math.floor(math.log10(span / count))

    def ticks_with(spacing: float) -> int:
        return math.floor(hi / spacing + 1e-9) - math.ceil(lo / spacing - 1e-9) + 1

    # The spacing whose number of ticks comes closest to ``count``, the more ticks on a tie.
    candidates = [m * magnitude for m in (1, 2, 5, 10) if not whole or m * magnitude >= 1] or [1.0]
    spacing = min(candidates, key=lambda s: abs(ticks_with(s) - count))
    first = math.ceil(lo / spacing - 1e-9)
    ticks = []
    i = first
    while i * spacing <= hi + spacing * 1e-9:
        ticks.append(0.0 if i == 0 else round(i * spacing, 12))
        i += 1
    return ticks, spacing


def _log_ticks(lo: float, hi: float) -> tuple[list[float], list[str], list[float]]:
    """Ticks, their labels and minor grid lines for a log axis over [lo, hi] (values > 0)."""
    llo, lhi = math.log10(lo), math.log10(hi)
    first, last = math.ceil(llo - 1e-9), math.floor(lhi + 1e-9)
    decades = last - first + 1
    minor: list[float] = []
    if decades >= 2:
        every = max(1, math.ceil(decades / 5))
        # Every ``every``-th power of ten, counted from 10**0 so that 1 is a tick whenever it is in view.
        exponents = [e for e in range(first, last + 1) if e % every == 0]
        ticks = [10.0**e for e in exponents]
        if every == 1 and lhi - llo <= 8:
            minor = [m * 10.0**e for e in range(first - 1, last + 1) for m in range(2, 10) if lo <= m * 10.0**e <= hi]
        return ticks, [_power_label(e) for e in exponents], minor
    ticks = [m * 10.0**e for e in range(first - 1, last + 1) for m in (1, 2, 5) if lo <= m * 10.0**e <= hi]
    if len(ticks) < 2:  # under one decade: round linear ticks, placed on the log axis
        ticks, _ = _nice_ticks(lo, hi)
        ticks = [t for t in ticks if t > 0]
    return ticks, [_log_tick_label(t) for t in ticks], minor


def debiased_ema(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average divided by its bias towards the
    starting zero, so the first points are not pulled down. Non-finite values are passed
    through and leave the average alone; a constant series stays exactly constant."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), not {weight!r}")
    values = list(values)
    finite = [v for v in values if math.isfinite(v)]
    if weight == 0.0 or (finite and all(v == finite[0] for v in finite)):
        return values
    last, count, out = 0.0, 0, []
    for value in values:
        if not math.isfinite(value):
            out.append(value)
            continue
        last = last * weight + (1.0 - weight) * value
        count += 1
        out.append(last / (1.0 - weight**count))
    return out


def downsample(steps: Sequence[float], values: Sequence[float],
               limit: int = CHART_POINTS) -> tuple[list[float], list[float]]:
    """At most ``limit`` evenly strided points, always the first and the last."""
    n = min(len(steps), len(values))
    if n <= limit:
        return list(steps[:n]), list(values[:n])
    stride = -(-(n - 1) // (limit - 1))
    indices = list(range(0, n - 1, stride)) + [n - 1]
    return [steps[i] for i in indices], [values[i] for i in indices]


def is_constant(values: Sequence[float]) -> bool:
    """Whether a metric is one finite value logged at least twice (a learning rate that never
    changes): worth a line of text, not a chart."""
    if len(values) < 2:
        return False
    first = values[0]
    if not math.isfinite(first) or values[-1] != first:
        return False
    try:
        view = memoryview(values)  # an array('d') of the record: compared in C, no float per value
    except TypeError:
        view = None
    if view is not None and view.format == "d" and view.ndim == 1:
        return view[1:] == view[:-1]
    return all(v == first for v in values)


# -- one chart ---------------------------------------------------------------

class _Line:
    def __init__(self, label: str, colour: str, steps: Sequence[float], values: Sequence[float], smoothing: float):
        self.label = label
        self.colour = colour
        self.count = min(len(steps), len(values))
        xs, ys = downsample(steps, values)
        keep = [i for i, x in enumerate(xs) if math.isfinite(x)]
        self.xs = [float(xs[i]) for i in keep]
        self.raw = [float(ys[i]) for i in keep]
        self.smooth = debiased_ema(self.raw, smoothing) if smoothing > 0 else None
        self.latest = float(values[self.count - 1]) if self.count else math.nan
        self.latest_step = float(steps[self.count - 1]) if self.count else math.nan
        self.latest_smooth = self.smooth[-1] if self.smooth else None

    def shown(self) -> list[float]:
        return self.smooth if self.smooth is not None else self.raw


def _scale_for(values: list[float], scale: str) -> str:
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}, not {scale!r}")
    if scale != "auto":
        return scale
    finite = [v for v in values if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) >= 10.0**LOG_DECADES:
        return "log"
    return "linear"


def scales_shown(series_by_metric: dict[str, list[Series]], scale: str = "auto") -> dict[str, str]:
    """The scale each metric's chart is drawn with under ``scale``: "auto" resolved to "linear" or "log"."""
    return {name: _scale_for([float(v) for _, _, values in lines for v in values], scale)
            for name, lines in series_by_metric.items()}


def _points(xs: list[float], ys: list[float], ok, sx, sy) -> list[tuple[float, float]]:
    return [(sx(x), sy(y)) for x, y in zip(xs, ys) if ok(y)]


def _polyline(points: list[tuple[float, float]], colour: str, width: float, opacity: float, kind: str) -> str:
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    return (f'<polyline class="hvdmagic-line-{kind}" fill="none" stroke="{colour}" stroke-width="{width}" '
            f'stroke-opacity="{opacity}" stroke-linejoin="round" stroke-linecap="round" pointer-events="none" '
            f'points="{path}"/>')


def chart_html(name: str, series: list[Series], *, scale: str = "auto", smoothing: float = 0.0,
               width: int = 320, height: int = 130) -> str:
    """One metric as an inline SVG line chart, one line per ``(label, steps, values)`` series.

    Args:
        name: the metric, printed in the chart's header.
        series: one ``(label, steps, values)`` per line, e.g. ``("rank 0", steps, values)``;
            the header's latest value is the first series'.
        scale: "linear", "log", or "auto": log when every finite value is positive and they span
            at least two decades. An explicit "log" leaves out non-positive values, with a note.
        smoothing: TensorBoard's smoothing weight in [0, 1): the debiased moving average is drawn
            solid over the faint raw line. 0 draws the raw line alone.
        width, height: the SVG's size in pixels.

    Returns:
        ``<div class="hvdmagic-chart" data-metric=... data-scale=...><svg>...</svg>...</div>``
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), not {smoothing!r}")
    lines = [_Line(str(label), PALETTE[i % len(PALETTE)], steps, values, smoothing)
             for i, (label, steps, values) in enumerate(series)]
    every_value = [v for line in lines for v in line.raw]
    scale = _scale_for(every_value, scale)
    log = scale == "log"

    def plotted(value: float) -> bool:
        return math.isfinite(value) and (value > 0 or not log)

    notes = []
    if log:
        dropped = sum(1 for v in every_value if math.isfinite(v) and v <= 0)
        if dropped:
            notes.append(f"{dropped} value(s) ≤ 0 not shown on the log scale")
    ys = [v for line in lines for v in line.raw + (line.smooth or []) if plotted(v)]
    xs = [x for line in lines for x in line.xs]

    top, bottom, right = 24, height - 17, width - 10
    # The y axis: its domain, padded a little, and its ticks.
    minor: list[float] = []
    if ys:
        lo, hi = min(ys), max(ys)
        if log:
            llo, lhi = math.log10(lo), math.log10(hi)
            pad = (lhi - llo) * 0.05 or 0.5
            lo, hi = 10.0 ** (llo - pad), 10.0 ** (lhi + pad)
            yticks, ylabels, minor = _log_ticks(lo, hi)
        else:
            pad = (hi - lo) * 0.06 or (abs(lo) * 0.1 or 1.0)
            lo, hi = lo - pad, hi + pad
            yticks, spacing = _nice_ticks(lo, hi)
            ylabels = [_tick_label(t, spacing) for t in yticks]
    else:
        lo, hi, yticks, ylabels = (1.0, 10.0, [], []) if log else (0.0, 1.0, [], [])
    left = max(28, 8 + 6 * max((len(label) for label in ylabels), default=1))
    if log:
        llo, lhi = math.log10(lo), math.log10(hi)

        def sy(y: float) -> float:
            return bottom - (math.log10(y) - llo) / (lhi - llo) * (bottom - top)
    else:
        def sy(y: float) -> float:
            return bottom - (y - lo) / (hi - lo) * (bottom - top)

    # The x axis: steps.
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
        xticks = [x0 + 1]
    else:
        whole = all(float(x).is_integer() for x in xs)
        xticks, _ = _nice_ticks(x0, x1, count=max(2, (right - left) // 70), whole=whole)

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (right - left)

    label = html.escape(name)
    parts = [
        f'<svg class="hvdmagic-chart-svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{label}" font-family="{html.escape(_FONT)}" font-size="10" '
        f'style="display:block;overflow:hidden">',
        f'<rect x="0.5" y="0.5" width="{width - 1}" height="{height - 1}" rx="3" fill="white" stroke="#e0e0e0"/>',
    ]
    # The header: the metric on the left, its latest value on the right.
    first = lines[0] if lines else None
    latest = first.latest if first else math.nan
    if first is not None and first.latest_smooth is not None:
        value_text = (f'<tspan font-weight="600">{html.escape(value_label(first.latest_smooth))}</tspan>'
                      f'<tspan fill="{_MUTED}" font-size="10"> raw {html.escape(value_label(latest))}</tspan>')
        value_chars = len(value_label(first.latest_smooth)) + 5 + len(value_label(latest))
    else:
        value_text = html.escape(value_label(latest))
        value_chars = len(value_label(latest))
    room = max(4, int((width - 16 - value_chars * 6.6 - 10) / 7))
    shown_name = name if len(name) <= room else name[: room - 1] + "…"
    parts.append(f'<text x="8" y="15" font-size="12" font-weight="600" fill="#222">'
                 f'<title>{label}</title>{html.escape(shown_name)}</text>')
    parts.append(f'<text class="hvdmagic-latest" x="{width - 8}" y="15" font-size="11" text-anchor="end" '
                 f'fill="#222">{value_text}</text>')
    # Grid lines and tick labels.
    for y in minor:
        parts.append(f'<line x1="{left}" x2="{right}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="#f5f5f5"/>')
    for y, text in zip(yticks, ylabels):
        py = sy(y)
        parts.append(f'<line x1="{left}" x2="{right}" y1="{py:.1f}" y2="{py:.1f}" stroke="{_GRID}"/>')
        parts.append(f'<text class="hvdmagic-ytick" x="{left - 4}" y="{py + 3:.1f}" text-anchor="end" '
                     f'fill="{_MUTED}" font-size="9">{html.escape(text)}</text>')
    parts.append(f'<line x1="{left}" x2="{right}" y1="{bottom}" y2="{bottom}" stroke="{_AXIS}"/>')
    for x in xticks:
        px = sx(x)
        anchor = "end" if px > right - 12 else "middle"
        parts.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{bottom}" y2="{bottom + 3}" stroke="{_AXIS}"/>')
        parts.append(f'<text class="hvdmagic-xtick" x="{px:.1f}" y="{height - 5}" text-anchor="{anchor}" '
                     f'fill="{_MUTED}" font-size="9">{html.escape(_si(x))}</text>')
    if not ys:
        message = "no positive values to show on a log scale" if log and every_value else "no finite values"
        parts.append(f'<text x="{(left + right) / 2:.1f}" y="{(top + bottom) / 2 + 3:.1f}" text-anchor="middle" '
                     f'fill="{_MUTED}">{message}</text>')
    # Hover targets first, under the lines: one invisible band per step shown.
    parts.extend(_bands(lines, sx, top, bottom, left, right))
    # The lines: raw faint behind the smoothed one, as TensorBoard draws them.
    for line in lines:
        if line.smooth is not None:
            raw = _points(line.xs, line.raw, plotted, sx, sy)
            if len(raw) > 1:
                parts.append(_polyline(raw, line.colour, 1, 0.28, "raw"))
        points = _points(line.xs, line.shown(), plotted, sx, sy)
        if len(points) > 1:
            parts.append(_polyline(points, line.colour, 1.6, 1, "smoothed" if line.smooth is not None else "raw"))
        elif len(points) == 1:
            (px, py), = points
            value = next(v for v in line.shown() if plotted(v))
            anchor, dx = ("end", -6) if px > (left + right) / 2 + 40 else ("start", 6)
            parts.append(f'<circle class="hvdmagic-dot" cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="{line.colour}" '
                         f'pointer-events="none"/>')
            parts.append(f'<text x="{px + dx:.1f}" y="{py - 5:.1f}" text-anchor="{anchor}" font-size="10" '
                         f'fill="{line.colour}" pointer-events="none">{html.escape(value_label(value))}</text>')
    parts.append("</svg>")
    extra = ""
    if len(lines) > 1:
        extra += _legend(lines)
    if notes:
        note_style = f"font-size:10px;line-height:13px;color:#a60;padding:1px 4px;font-family:{html.escape(_FONT)}"
        extra += "".join(f'<div class="hvdmagic-chart-note" style="{note_style}">{html.escape(note)}</div>'
                         for note in notes)
    return (f'<div class="hvdmagic-chart" data-metric="{label}" data-scale="{scale}" '
            f'style="display:inline-block;vertical-align:top;font-size:0px;line-height:0px;width:{width}px">'
            + "".join(parts) + extra + "</div>")


def _bands(lines: list[_Line], sx, top: float, bottom: float, left: float, right: float) -> list[str]:
    """Invisible rectangles, one per step shown, whose ``<title>`` is the tooltip."""
    steps = sorted({x for line in lines for x in line.xs})
    if not steps:
        return []
    if len(steps) > CHART_POINTS:
        steps, _ = downsample(steps, steps)
    lookup = [dict(zip(line.xs, range(len(line.xs)))) for line in lines]
    centres = [sx(x) for x in steps]
    out = ['<g class="hvdmagic-hover" fill="transparent">']
    for i, (step, centre) in enumerate(zip(steps, centres)):
        start = left if i == 0 else (centres[i - 1] + centre) / 2
        end = right if i == len(steps) - 1 else (centre + centres[i + 1]) / 2
        if len(lines) == 1:
            text = f"step {step_label(step)}: value {_describe(lines[0], lookup[0][step])}"
        else:
            rows = [f"step {step_label(step)}"]
            for line, where in zip(lines, lookup):
                index = where.get(step)
                if index is None:
                    if not line.xs:
                        continue
                    index = min(bisect_left(line.xs, step), len(line.xs) - 1)
                    rows.append(f"{line.label}: {_describe(line, index)} (step {step_label(line.xs[index])})")
                else:
                    rows.append(f"{line.label}: {_describe(line, index)}")
            text = "\n".join(rows)
        out.append(f'<rect x="{start:.1f}" y="{top}" width="{max(end - start, 0.5):.1f}" height="{bottom - top}">'
                   f"<title>{html.escape(text)}</title></rect>")
    out.append("</g>")
    return out


def _describe(line: _Line, index: int) -> str:
    raw = _hover_value(line.raw[index])
    if line.smooth is None:
        return raw
    return f"{raw} (smoothed {_hover_value(line.smooth[index])})"


def _legend(lines: list[_Line]) -> str:
    items = "".join(
        f'<span style="white-space:nowrap;margin-right:10px">'
        f'<span style="display:inline-block;width:12px;height:3px;background-color:{line.colour};'
        f'vertical-align:middle;margin-right:3px"></span>{html.escape(line.label)} '
        f'<span style="color:{_MUTED}">{html.escape(value_label(line.latest))}</span></span>'
        for line in lines)
    return (f'<div class="hvdmagic-legend" style="font-size:10px;line-height:14px;padding:2px 4px;'
            f'font-family:{html.escape(_FONT)}">{items}</div>')


# -- every metric ------------------------------------------------------------

def series_by_metric(rank0_series: dict, label: str = "rank 0") -> dict[str, list[Series]]:
    """``record.rank0_series`` (name -> (steps, values)) as ``metrics_html`` takes it."""
    return {name: [(label, xs, ys)] for name, (xs, ys) in rank0_series.items() if len(xs)}


def _constant(lines: list[Series]) -> float | None:
    """The value when every series is the same constant, else None."""
    values = [values for _, _, values in lines]
    if not values or not all(is_constant(v) for v in values):
        return None
    first = values[0][0]
    return first if all(v[0] == first for v in values) else None


def constant_row(name: str, value: float, count: int) -> str:
    """A metric that never changed, as one line: ``lr  0.01 (constant over 200 steps)``."""
    return (f'<div class="hvdmagic-constant" data-metric="{html.escape(name)}" '
            f'style="font-size:12px;white-space:nowrap;padding:1px 0">'
            f"<b>{html.escape(name)}</b>&#160; <code>{html.escape(value_label(value))}</code> "
            f'<span style="color:{_MUTED}">(constant over {count} steps)</span></div>')


def _constants(series: dict[str, list[Series]]) -> dict[str, tuple[float, int]]:
    """name -> (value, values logged) of each constant metric."""
    out = {}
    for name, lines in series.items():
        value = _constant(lines)
        if value is not None:
            out[name] = (value, max(len(v) for _, _, v in lines))
    return out


def latest_table_html(series: dict[str, list[Series]], *, smoothing: float = 0.0) -> str:
    """The latest value of each metric's first series: metric, step, latest (and smoothed)."""
    labels = {lines[0][0] for lines in series.values() if lines}
    head = f"metric ({labels.pop()})" if len(labels) == 1 else "metric"
    cell = "padding:1px 8px 1px 0;text-align:left;white-space:nowrap"
    number = "padding:1px 8px 1px 0;text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums"
    header = [f'<th style="{cell}">{html.escape(head)}</th>', f'<th style="{number}">step</th>',
              f'<th style="{number}">latest</th>']
    if smoothing > 0:
        header.append(f'<th style="{number}">smoothed</th>')
    rows = []
    for name, lines in sorted(series.items()):
        if not lines:
            continue
        _, steps, values = lines[0]
        n = min(len(steps), len(values))
        if not n:
            continue
        cells = [f'<td style="{cell}">{html.escape(name)}</td>',
                 f'<td style="{number}">{html.escape(step_label(float(steps[n - 1])))}</td>',
                 f'<td style="{number}">{html.escape(f"{values[n - 1]:.5g}")}</td>']
        if smoothing > 0:
            _, shown = downsample(steps, values)
            cells.append(f'<td style="{number}">{html.escape(f"{debiased_ema(shown, smoothing)[-1]:.5g}")}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<table class="hvdmagic-metrics" style="border-collapse:collapse;font-size:12px">'
            f'<thead><tr style="border-bottom:1px solid #ddd">{"".join(header)}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>")


def metrics_html(series_by_metric: dict[str, list[Series]], *, scale: str | dict[str, str] = "auto",
                 smoothing: float = 0.0, table: bool = True, width: int = 320, height: int = 130) -> str:
    """Every metric: a grid of charts, a compact row per constant metric, and the latest-values table.

    Args:
        series_by_metric: metric name -> ``[(label, steps, values), ...]``, one line per series;
            ``series_by_metric(record.rank0_series)`` gives rank 0's.
        scale, smoothing: as for ``chart_html``, for every chart; ``scale`` may also give each
            metric its own (metric -> scale; "auto" for one it does not name).
        table: whether to add the latest-values table (beside the charts, or under them when narrow).
    """
    series = {name: lines for name, lines in series_by_metric.items()
              if any(min(len(s), len(v)) for _, s, v in lines)}
    if not series:
        return ""
    constant = _constants(series)
    scales = scale if isinstance(scale, dict) else dict.fromkeys(series, scale)
    charts = "".join(chart_html(name, lines, scale=scales.get(name, "auto"), smoothing=smoothing,
                                width=width, height=height)
                     for name, lines in sorted(series.items()) if name not in constant)
    constants = "".join(constant_row(name, value, count) for name, (value, count) in sorted(constant.items()))
    left = ""
    if charts:
        left += f'<div class="hvdmagic-charts" style="display:flex;flex-wrap:wrap;gap:6px">{charts}</div>'
    if constants:
        left += f'<div class="hvdmagic-constants" style="margin-top:4px">{constants}</div>'
    right = (f'<div style="flex:0 0 auto">{latest_table_html(series, smoothing=smoothing)}</div>'
             if table else "")
    # The charts' row as wide as its charts, so the table sits right beside them, or under them
    # when the row and the table do not fit side by side.
    basis = max(1, len(series) - len(constant)) * (width + 6)
    return (f'<div class="hvdmagic-metrics-view" style="display:flex;flex-wrap:wrap;gap:12px;'
            f'align-items:flex-start"><div style="flex:0 1 {basis}px;min-width:{width}px">{left}</div>'
            f"{right}</div>")
