"""Progress as text: the rows, stage lines and overall progress that every view shares.

As tqdm's ``format_meter`` serves both tqdm and tqdm.notebook, these pure functions
turn a rank's bars into text for the widget dashboard, the text view and the snapshot.
A row reads like tqdm, with Keras' epoch counter in front when the loop has an outer bar:

    epoch 3/5     train         45% ████████▉           45/100    15.2 it/s  0:03<0:04

Every field has a fixed width and numbers are right-aligned in theirs, so a row keeps
its width (and, drawn without wrapping, its height) while its numbers change.

Nested ``hvdmagic.track`` calls give a rank two bars: an outer one (``desc="epoch"``)
that never restarts, and an inner one that restarts every epoch (``step < bar.step``
starts it over in the record). ``pick_bars`` tells them apart from the record alone,
and ``fraction`` turns them into the run's overall progress:
``(outer.step + inner.step / inner.total) / outer.total``.

The rate is smoothed as tqdm smooths it (an exponential moving average, weight 0.3,
of the steps and the seconds between updates, debiased) by a ``Meter`` that a view
keeps per bar; it carries over when a bar restarts, so it does not vanish at each new
epoch. No ETA is shown until there is a rate.
"""

from __future__ import annotations

import math
import time

from hvdmagic import rank_ranges
from hvdmagic.kernel import stragglers
from hvdmagic.kernel.record import Bar, RankRecord, RunRecord
from hvdmagic.protocol import Stage

SMOOTHING = 0.3  # tqdm's default: the weight of the newest update in the moving averages
EPOCH_WIDTH = 13  # "epoch 999/999"
DESC_WIDTH = 12
COUNT_WIDTH = 5  # each side of "45/100"; larger counts are shortened, 123k
COUNT_COLUMN = 2 * COUNT_WIDTH + 1  # "   45/100  "
RATE_WIDTH = 10  # "15.2k it/s"
TIMES_WIDTH = 15  # "1:02:03<1:02:03"
BAR_WIDTH = 20  # the text bar of the text view and the snapshot's text
_BLOCKS = " ▏▎▍▌▋▊▉█"

Named = tuple[str, Bar]  # (desc, bar)


# -- numbers ------------------------------------------------------------------

STATE_COLOURS = {"launching": "#888", "running": "#1f77b4", "finished": "#2ca02c", "ready": "#2ca02c",
                 "failed": "#d62728", "cancelled": "#ff7f0e", "stopped": "#888", "lost": "#999", "unused": "#bbb",
                 "idle": "#bbb"}
UP = ("finished", "ready")  # the states of a rank that ended well, or that a session keeps up


def row_name(record: RunRecord, row: int) -> str:
    """What a row is called: a rank, or in an elastic run a task (its ranks change at resets)."""
    return f"task {row}" if record.elastic else f"rank {row}"


def state_or_debugger(rank: RankRecord) -> str:
    """The rank's state, or "in the debugger" while it is stopped at breakpoint()."""
    return "in the debugger" if rank.in_debugger and rank.state == "running" else rank.state


def row_state(rank: RankRecord) -> str:
    """A row's state, with why an elastic task's rank was lost, or how long the kernel has not heard its task;
    "in the debugger" while the rank is stopped at breakpoint()."""
    shown = state_or_debugger(rank)
    if rank.state == "lost" and rank.lost:
        return f"lost: {rank.lost}"
    if shown == rank.state and rank.out_of_contact_since is not None and rank.state not in UP:  # pdb's wait first
        return f"no contact for {max(0, time.time() - rank.out_of_contact_since):.0f} s"
    return shown


def where_it_ended(rank: RankRecord) -> str | None:
    """Where a rank that failed or was stopped was: where the run's error says (``RankRecord.ended_in``:
    "in the cell (Cell In[15], line 6)", "while training"), else its stage: "at hvd.init".

    Its first stage, ``importing``, lasts from its start until the cell imports horovod (a
    ``%%torchrun`` cell's rank, until its first output): a rank that ended there ended "in the
    cell", whatever the cell was doing. None for a rank that finished or stays up, or that trained
    and ended where nothing says.
    """
    if rank.state in UP:
        return None
    if rank.ended_in:
        return rank.ended_in
    if rank.stage is None or rank.stage is Stage.TRAINING:
        return None
    return "in the cell" if rank.stage is Stage.IMPORTING else f"at {rank.stage}"


def after_failure_line(counts: list[int]) -> str:
    """The line the ranks' output after the run's failure folds under: it followed the stop."""
    ranks = [rank for rank, count in enumerate(counts) if count]
    return (f"hvdmagic: {sum(counts)} more line(s) from {rank_ranges.label(ranks)}, printed once the run had "
            "failed, as the ranks were stopped: in hvdmagic.last_run().logs")


def size_text(record: RunRecord) -> str:
    """"np=4 (spark)", a session's cell on some ranks "np=4 (spark) on rank 0", or for an elastic run
    "3 ranks, elastic 2-4 (spark)"."""
    if not record.elastic:
        only = f" on {rank_ranges.label(record.only)}" if record.only is not None else ""
        return f"np={record.np} ({record.mode}){only}"
    low, _, high = record.elastic
    ranks = f"{record.world_size} rank{'s' if record.world_size != 1 else ''}"
    return f"{ranks}, elastic {low}-{high} ({record.mode})"


def duration(seconds: float | None) -> str:
    """Seconds as m:ss, or h:mm:ss from an hour on; "?" when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    return f"{seconds // 60}:{seconds % 60:02d}"


def count(n: float) -> str:
    """A step count in at most five characters: 42, 2.5, 99999, 123k, 1.23M."""
    if not math.isfinite(n):
        return str(n)
    if abs(n) < 99_999.5:
        return str(round(n)) if float(n).is_integer() or abs(n) >= 1000 else f"{n:.4g}"[:COUNT_WIDTH]
    for limit, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= limit:
            scaled = n / limit
            return (f"{scaled:.3g}" if abs(scaled) < 999.5 else f"{scaled:.0f}") + suffix
    return str(n)  # not reached


def _sig3(x: float) -> str:
    """Three significant digits with k/M/G: 0.123, 15.2, 152, 1.52k."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= limit * 0.9995:
            return f"{x / limit:.3g}{suffix}"
    return f"{x:.3g}"


def rate_text(rate: float | None, unit: str = "it") -> str:
    """Steps a second as tqdm writes them: "15.2 it/s", or "2.31 s/it" below one a second."""
    if rate is None or not rate > 0 or not math.isfinite(rate):
        return ""
    if rate >= 0.9995:
        return f"{_sig3(rate)} {unit}/s"
    seconds = 1 / rate
    return f"{seconds:.3g} s/{unit}" if seconds < 99.95 else f"{duration(seconds)}/{unit}"


def fit(text: str, width: int) -> str:
    """``text`` in exactly ``width`` characters: padded, or cut with an ellipsis."""
    return text.ljust(width) if len(text) <= width else text[: width - 1] + "…"


def bar_text(fraction: float | None, width: int = BAR_WIDTH) -> str:
    """A text progress bar of ``width`` characters, in eighths of a block like tqdm's."""
    if fraction is None:
        return " " * width
    eighths = int(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (_BLOCKS[part] if part else "")).ljust(width)


# -- smoothing ------------------------------------------------------------------

class EMA:
    """tqdm's exponential moving average, debiased for its first calls."""

    def __init__(self, smoothing: float = SMOOTHING):
        self.alpha = smoothing
        self.last = 0.0
        self.calls = 0

    def __call__(self, x: float | None = None) -> float:
        beta = 1 - self.alpha
        if x is not None:
            self.last = self.alpha * x + beta * self.last
            self.calls += 1
        return self.last / (1 - beta**self.calls) if self.calls else self.last


class Meter:
    """The smoothed rate of one bar (or of any count), fed its ``(step, time)`` as it changes.

    A view keeps one per bar and feeds it each redraw; an unchanged sample is ignored.
    A step below the last one (the bar restarted for the next epoch) only re-anchors the
    meter: the epoch before's rate carries over, so the rate and ETA do not flicker.
    """

    def __init__(self, smoothing: float = SMOOTHING):
        self._dn = EMA(smoothing)
        self._dt = EMA(smoothing)
        self._last: tuple[float, float] | None = None

    def update(self, step: float, stamp: float) -> float | None:
        last = self._last
        if last is not None and (step, stamp) == last:
            return self.rate
        if last is not None and step >= last[0] and stamp > last[1]:
            self._dn(step - last[0])
            self._dt(stamp - last[1])
        self._last = (step, stamp)
        return self.rate

    def anchor(self, step: float, stamp: float) -> None:
        """Count from ``(step, stamp)`` on, keeping the rate so far: another bar of the same loop."""
        self._last = (step, stamp)

    @property
    def rate(self) -> float | None:
        if not self._dn.calls:
            return None
        dn, dt = self._dn(), self._dt()
        return dn / dt if dn > 0 and dt > 0 else None


# -- a rank's bars ----------------------------------------------------------------

def pick_bars(bars: dict[str, Bar]) -> tuple[Named | None, Named | None]:
    """``(outer, inner)`` of a rank's bars, each ``(desc, bar)`` or None.

    The inner bar is the one started (or restarted) most recently. An outer bar is an
    older bar with a total that was still running when the inner one started, or that
    moved after it (the epoch loop's last step comes after the last batch): a loop of
    ``track(range(epochs), desc="epoch")`` around ``track(loader, desc="train")``. Bars that
    ran one after the other (``desc=f"epoch {e}"``, or "train" then "val") have no outer.
    """
    items = list(bars.items())
    if not items:
        return None, None
    newest = max(range(len(items)), key=lambda i: (items[i][1].first_time, i))
    inner = items[newest]
    for i, (desc, bar) in enumerate(items):
        if i == newest or bar.total is None or not bar.total > 0:
            continue
        if bar.step < bar.total or bar.time >= inner[1].time:
            return (desc, bar), inner
    return None, inner


def _inner_fraction(outer: Bar | None, inner: Bar) -> float:
    if not inner.total or (outer is not None and inner.first_time < outer.time):
        return 0.0  # no total, or the epoch before's bar: the outer bar has moved on since
    return max(0.0, min(1.0, inner.step / inner.total))


def fraction(outer: Named | None, inner: Named | None) -> float | None:
    """How far bars ``pick_bars`` picked have got, 0 to 1, or None when they do not say.

    With an outer bar: ``(outer.step + inner.step / inner.total) / outer.total``. Without one,
    the inner bar's own fraction when it has a total and never restarted.
    """
    if outer is not None:
        bar = outer[1]
        part = _inner_fraction(bar, inner[1]) if inner is not None else 0.0
        return max(0.0, min(1.0, (min(bar.step, bar.total) + part) / bar.total))
    if inner is not None:
        bar = inner[1]
        if bar.total and bar.total > 0 and bar.restarts == 0:
            return max(0.0, min(1.0, bar.step / bar.total))
    return None


def rank_fraction(bars: dict[str, Bar]) -> float | None:
    """How far a rank is through its whole run, from its bars; None when they do not say.

    Nested bars say it (see ``fraction``), and so does a rank's only bar when it has a total
    and never restarted (``progress(step, total=…)`` over the run). Bars one after the
    other (``desc=f"epoch {e}"``, "train" then "val") or a bar that restarts each epoch
    with no outer bar do not.
    """
    outer, inner = pick_bars(bars)
    if outer is None and len(bars) != 1:
        return None
    return fraction(outer, inner)


def epoch_text(outer: Named) -> str:
    """The outer bar as Keras counts epochs: the one under way, "epoch 3/5"."""
    desc, bar = outer
    total = bar.total or 0
    current = bar.step if bar.step >= total else bar.step + 1
    numbers = f"{count(current)}/{count(total)}"
    label = desc.strip() or "epoch"
    room = EPOCH_WIDTH - len(numbers) - 1
    if len(label) > room:
        label = label[: max(1, room - 1)] + "…"
    return f"{label} {numbers}"


def run_fraction(record: RunRecord) -> tuple[float, Named | None] | None:
    """The run's overall progress: the slowest rank's ``fraction``, with its outer bar; None if unknown."""
    slowest = None
    for rank in record.ranks:
        bars = dict(rank.bars)
        value = rank_fraction(bars)
        if value is not None and (slowest is None or value < slowest[0]):
            slowest = (value, pick_bars(bars)[0])
    return slowest


# -- rows ----------------------------------------------------------------------------

def stage_label(rank: RankRecord) -> str:
    """The start-up stage a rank's row names: "importing tensorflow" while the rank imports a framework
    (``rank.framework_imports``; the rank's stage until it trains), else its stage: "importing", "hvd.init"."""
    return f"{Stage.IMPORTING} {rank.importing}" if rank.importing else str(rank.stage)


def _importing_label(record: RunRecord) -> str:
    """The run's importing stage as its ranks still in it say it: "importing tensorflow" when they
    all import the same framework now, else "importing"."""
    labels = {stage_label(rank) for rank in record.ranks if rank.stage is Stage.IMPORTING}
    return labels.pop() if len(labels) == 1 else str(Stage.IMPORTING)


def stage_text(stage: Stage | str, seconds: float | None) -> str:
    """A start-up stage and the time spent in it: "starting the embedded Spark for 0:07".

    Said in words, as ``elapsed_text`` is, because the header shows both times side by side."""
    return f"{stage} for {duration(seconds)}" if seconds is not None else str(stage)


def elapsed_text(seconds: float) -> str:
    """The run's time so far, or in all once it ended: "elapsed 0:12"."""
    return f"elapsed {duration(seconds)}"


def state_text(state: str) -> str:
    """A run's state as a header says it; the error itself is the cell's error output."""
    return {"failed": "failed: see the error below", "cancelled": "interrupted"}.get(state, state)


def run_stage(record: RunRecord, now: float | None = None) -> str | None:
    """While the run starts, its stage and the time spent in it (or, while the cell's large
    values are on their way to the hosts, how far they are); None once every rank trains."""
    shipping = record.shipping
    if shipping is not None and not shipping.get("done") and record.state in ("launching", "running"):
        return str(shipping.get("text", ""))
    if record.state not in ("launching", "running") or record.stage in (None, Stage.TRAINING):
        return None
    since = record.stage_reached.get(record.stage, record.started)
    seconds = (now if now is not None else time.time()) - since
    if record.stage is Stage.SPARK_STARTING:
        return spark_starting_text(record.np, seconds)
    stage = _importing_label(record) if record.stage is Stage.IMPORTING else record.stage
    return stage_text(stage, seconds)


SPARK_HINT_AFTER = 5.0  # seconds of the embedded Spark's start after which its stage says how to go without


def spark_starting_text(np: int, seconds: float | None) -> str:
    """The embedded Spark's start, as the stage line says it: once per kernel; and, once it takes a
    while (a JVM on a loaded laptop: most of a minute), that local mode needs no Spark."""
    text = stage_text(f"{Stage.SPARK_STARTING}, once per kernel{',' if seconds is not None else ''}", seconds)
    if seconds is None or seconds >= SPARK_HINT_AFTER:
        text += f" (--np -{np} runs on this machine without Spark)"
    return text


def left_width(epochs: bool) -> int:
    return (EPOCH_WIDTH + 2 if epochs else 0) + DESC_WIDTH + 5


def right_width(timing: bool = True) -> int:
    return COUNT_COLUMN + (2 + RATE_WIDTH + 2 + TIMES_WIDTH if timing else 0)


def left_columns(left: str, epochs: bool) -> tuple[str, str, str]:
    """A trained row's ``left`` (``row_parts``) in its columns: (epoch, the bar's name, its percentage),
    for a view that lets the first two give way in a narrow space."""
    epoch, rest = (left[:EPOCH_WIDTH + 2], left[EPOCH_WIDTH + 2:]) if epochs else ("", left)
    return epoch, rest[:DESC_WIDTH + 1], rest[DESC_WIDTH + 1:]


def right_columns(right: str) -> tuple[str, str, str]:
    """A trained row's ``right`` (``row_parts``, with timing) in its columns: (steps, rate, elapsed<ETA),
    the last two a fixed width at its end, whatever the steps' width."""
    times_at = len(right) - TIMES_WIDTH
    rate_at = times_at - RATE_WIDTH - 2
    return right[:rate_at], right[rate_at:times_at], right[times_at:]


def count_column(steps: str, total: float | None) -> str | None:
    """The steps column of a row, ``COUNT_COLUMN`` wide: "   45/100  ", the "/" in the same place on
    every row; a group's range ("145–150/300") right-aligned when it is longer; None when it does not fit."""
    total_text = count(total) if total is not None else ""
    text = f"{steps:>{COUNT_WIDTH}}{'/' if total_text else ' '}{total_text:<{COUNT_WIDTH}}"
    if len(text) > COUNT_COLUMN:
        text = f"{steps}/{total_text}".rjust(COUNT_COLUMN) if total_text else steps.rjust(COUNT_COLUMN)
    return text if len(text) <= COUNT_COLUMN else None


def row_parts(rank: RankRecord, *, rate: float | None = None, epochs: bool | None = None,
              timing: bool = True, now: float | None = None,
              steps: str | None = None) -> tuple[str, float | None, str]:
    """A rank's row as ``(left, bar fraction, right)``: a widget puts its progress bar between them.

    ``left`` is the epoch counter (when ``epochs``, by default when the rank has an outer bar),
    the bar's name and its percentage; ``right`` the steps and, with ``timing``, the rate
    (``rate``, e.g. a ``Meter``'s; by default the bar's average) and elapsed<remaining time;
    ``steps``, a steps column in place of the rank's own (a group's range, ``count_column``).
    A rank still starting shows its stage (``stage_label``) and the time in it instead
    (``starting_stage`` has the stage whole, for a view that lets it run over the empty bar).
    Each part has the same width whatever its numbers: ``left_width(epochs)`` and ``right_width(timing)``.
    """
    outer, inner = pick_bars(dict(rank.bars))
    if epochs is None:
        epochs = outer is not None
    lw, rw = left_width(epochs), right_width(timing)
    if inner is None:
        if (stage := starting_stage(rank)) is not None:
            since = rank.importing_since if rank.importing else rank.stage_since
            seconds = None
            if timing and since is not None:
                seconds = (now if now is not None else time.time()) - since
            return fit(stage, lw), None, fit(duration(seconds) if seconds is not None else "", rw)
        return " " * lw, None, " " * rw
    desc, bar = inner
    done = None
    if bar.total and bar.total > 0:
        done = max(0.0, min(1.0, bar.step / bar.total))
    percent = f"{int(done * 100):3d}%" if done is not None else "    "
    left = (fit(epoch_text(outer), EPOCH_WIDTH) + "  " if epochs and outer is not None else
            " " * (EPOCH_WIDTH + 2) if epochs else "")
    left += fit(desc, DESC_WIDTH) + " " + percent
    right = steps if steps is not None else count_column(count(bar.step), bar.total)
    if right is None:  # counts past 10**15 do not fit the column: shown whole, wider than it
        right = count(bar.step) + (f"/{count(bar.total)}" if bar.total is not None else "")
    if timing:
        rate = bar.rate if rate is None else rate
        elapsed = bar.time - bar.first_time
        eta = None
        if rate and bar.total is not None and bar.step < bar.total:
            eta = math.ceil((bar.total - bar.step) / rate)
        times = duration(elapsed) + (f"<{duration(eta)}" if eta is not None else "")
        right += f"  {fit(rate_text(rate), RATE_WIDTH).rstrip():>{RATE_WIDTH}}  {fit(times, TIMES_WIDTH)}"
    return fit(left, lw), done, fit(right, rw)


def starting_stage(rank: RankRecord) -> str | None:
    """What a rank that has not trained yet is doing, ``stage_label``; None once it trains or ended."""
    if rank.stage is None or rank.stage is Stage.TRAINING or rank.state not in ("launching", "running"):
        return None
    return stage_label(rank)


def row(rank: RankRecord, *, rate: float | None = None, epochs: bool | None = None, timing: bool = True,
        now: float | None = None, bar_width: int = BAR_WIDTH, steps: str | None = None) -> str:
    """A rank's row as one line of text, its bar drawn in blocks (see ``row_parts``). A rank still
    starting has no bar yet: its stage runs over the bar's room ("importing tensorflow" is longer
    than the left part), and the row keeps its width."""
    left, done, right = row_parts(rank, rate=rate, epochs=epochs, timing=timing, now=now, steps=steps)
    if not bar_width:
        return f"{left} {right}"
    if not rank.bars and (stage := starting_stage(rank)) is not None:
        return f"{fit(stage, len(left) + 1 + bar_width)} {right}"
    return f"{left} {bar_text(done, bar_width)} {right}"


def progress_summary(rank: RankRecord) -> str:
    """A rank's final progress, deterministic: "epoch 5/5 · train 40/40", or "" without bars."""
    outer, inner = pick_bars(dict(rank.bars))
    if inner is None:
        return ""
    desc, bar = inner
    total = f"/{bar.total:g}" if bar.total is not None else ""
    text = f"{desc} {bar.step:g}{total}" if desc else f"{bar.step:g}{total}"
    return f"{epoch_text(outer)} · {text}" if outer is not None else text


def overall_text(done: float, outer: Named | None, eta: float | None) -> str:
    """The run's overall progress: "epoch 3/5 ·  45% · ETA 0:30" (no ETA until there is a rate)."""
    parts = [epoch_text(outer)] if outer is not None else []
    parts.append(f"{int(done * 100):3d}%")
    if eta is not None:
        parts.append(f"ETA {duration(math.ceil(eta))}")
    return " · ".join(parts)


# -- what a rank uses, and whether it holds the others back ----------------------------

STRAGGLER_SIGN = "⚠"
SLOWER_TEXT = f"{round(stragglers.SLOWER * 100)} % or more"


def _bytes(size: float) -> str:
    return f"{size / 1e6:.0f} MB" if size < 1e9 else f"{size / 1e9:.1f} GB"


def usage_text(rank: RankRecord) -> str:
    """A rank's process tree as its supervisor last sampled it: "CPU 98 % · 312 MB", then each GPU
    it uses, "GPU 0 87 % 3.1/16 GB" (the rank's own memory where NVML tells it, else the device's);
    "" before the first sample (a quick cell has none), and once the rank has ended: its last
    sample would read as now, and a lost or failed rank's row says why instead."""
    if rank.cpu is None or rank.rss is None or rank.state != "running":
        return ""
    parts = [f"CPU {rank.cpu:.0f} %", _bytes(rank.rss)]
    for gpu in rank.gpus:
        used = gpu.get("rank_used")
        used = gpu.get("used", 0) if used is None else used
        parts.append(f"GPU {gpu.get('index', '?')} {gpu.get('util', 0):.0f} % "
                     f"{used / 1e9:.1f}/{gpu.get('total', 0) / 1e9:.0f} GB")
    return " · ".join(parts)


# Between a row's figures (the straggler marker, CPU, memory, GPUs) and its last output line, in the
# text views: a column rule, as the dashboard draws one, since the figures are " · "-separated themselves.
COLUMN_RULE = " │ "


def figures_and_line(figures: str, line: str) -> str:
    """The end of a row as text: "CPU 21 % · 399 MB │ epoch 3: loss 2.2154"; either may be ""."""
    return COLUMN_RULE.join(part for part in (figures, line) if part)


def straggler_text(rank: RankRecord) -> str:
    """The marker on a straggler's row, "⚠ 35 % slower"; "" for a rank that keeps up."""
    flag = rank.straggler
    return f"{STRAGGLER_SIGN} {round(flag.slower * 100)} % slower" if flag is not None else ""


def straggler_reason(record: RunRecord, rank: RankRecord) -> str:
    """Why a straggler keeps a row of its own in a grouped view (``grouping.OWN_ROW``): "straggler,
    35 % slower" while the run is live; "straggler" once it ended, so the final text stays the same."""
    flag = rank.straggler
    if flag is None:
        return ""
    return "straggler" if record.ended is not None else f"straggler, {round(flag.slower * 100)} % slower"


def stragglers_line(record: RunRecord, live: bool = True) -> str:
    """The header's line on the stragglers: "⚠ rank 3 is 35 % slower than the median: host …"; ""
    when none lags. Live, the ranks flagged now; at the end, every rank flagged in the run."""
    flags = [flag for flag in record.stragglers if flag.until is None or not live]
    flags = list({flag.rank: flag for flag in flags}.values())  # a rank flagged twice: its latest flag
    return (f"{STRAGGLER_SIGN} " + "; ".join(flag.describe(row_name(record, flag.rank), live) for flag in flags)
            if flags else "")
