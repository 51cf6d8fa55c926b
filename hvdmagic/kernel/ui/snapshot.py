"""The record that survives the kernel: a static view of a run that has ended.

The live dashboard is made of widgets, which a saved notebook shows only while
their kernel lives (and nbviewer or GitHub never). When a run ends, its output
is replaced by a ``Snapshot``: plain HTML with inline styles and no script, and
a text twin without timings, which the notebook stores like any other output.

What it shows: the final state, each rank's final progress and exit code, the
metric charts and latest values, the notes, and the tail of every rank's log.
Not the error's traceback: the cell's error output shows that.

A quick run that never showed its live widgets leaves a compact record instead
(``compact=True``), as ipyparallel's ``%px`` leaves ``Out[0:3]``: one line when it
finished with no output and no metrics, then its output lines. A failure, metrics or a
timeline keep the full record; every run's full record is ``hvdmagic.last_run()``.

The text/plain, what a front end without HTML shows, is the headline, the last
``TEXT_LINES`` lines of the ranks' output as the text view prefixes them, and the text
view's closing summary. The HTML carries the same text first, hidden (``hvdmagic-text``):
nbconvert's Markdown and AsciiDoc exports take the HTML over every text, and its reST
export takes it as raw HTML, so that is where the ranks' lines must be for them to keep
them. The HTML also has no blank line (``_no_blank_lines``): Markdown ends an HTML block
at the first one and reads the rest of the snapshot as Markdown.

A run of more than eight ranks is grouped (``grouping``): a row per group of ranks that
ended alike, each distinct output line once with its rank list, and every rank's own row
and log in a folded ``<details>`` below; a failed rank's log is also shown unfolded.
"""

from __future__ import annotations

import html
import re

from hvdmagic.kernel.noise import is_startup_noise
from hvdmagic.kernel.record import RankRecord, RunRecord
from hvdmagic.kernel.ui import charts, grouping, progress_text

TAIL_LINES = 20  # per rank, always visible
TEXT_LINES = 20  # of all ranks together, in the text/plain and the compact record
LOG_LINES = 200  # per rank, in its collapsed section
GROUPED_LINES = 40  # distinct lines of a many-rank run's grouped log, always visible
STATE_COLOURS = progress_text.STATE_COLOURS
_FONT = "-apple-system,BlinkMacSystemFont,'Segoe UI',Helvetica,Arial,sans-serif"
_MONO = "SFMono-Regular,Menlo,Consolas,'DejaVu Sans Mono',monospace"
_PRE = (f"margin:0;padding:4px 6px;background-color:#f7f7f7;border-radius:3px;font-family:{_MONO};"
        "font-size:11.5px;line-height:1.35;white-space:pre-wrap;word-break:break-word")
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


def _seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else progress_text.duration(seconds)


def _fraction(rank: RankRecord) -> float | None:
    value = progress_text.fraction(*progress_text.pick_bars(dict(rank.bars)))
    return 1.0 if value is None and rank.state == "finished" else value


def _elapsed(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else _seconds(seconds)


def _shares(counts: list[int], limit: int) -> list[int]:
    """How many of its last lines each rank shows, ``limit`` in all: even shares, and what a
    rank with fewer lines leaves goes to the others (so one talkative rank gets them all)."""
    shares = [0] * len(counts)
    left = limit
    open_ = [i for i, n in enumerate(counts) if n > 0]
    while left > 0 and open_:
        each = max(1, left // len(open_))
        for i in list(open_):
            take = min(each, counts[i] - shares[i], left)
            shares[i] += take
            left -= take
            if shares[i] == counts[i]:
                open_.remove(i)
            if not left:
                break
    return shares


def _last_lines(rank: RankRecord, count: int) -> list[tuple[str, str]]:
    """A rank's last ``count`` (stream, line) that are not start-up noise, without ANSI codes."""
    picked = []
    for stream, line in reversed(rank.logs):  # noise comes at start-up: the walk back rarely meets it
        if len(picked) == count:
            break
        if not is_startup_noise(line):
            picked.append((stream, _ANSI.sub("", line)))
    return picked[::-1]


def output_tail(record: RunRecord, limit: int = TEXT_LINES) -> list[tuple[int, int, list[tuple[str, str]]]]:
    """The run's last output lines, ``limit`` in all, grouped by rank so that they read the
    same whatever order the ranks' lines arrived in: ``(rank, earlier lines left out, lines)``
    for each rank that printed, each line ``(stream, text)``."""
    counts = [len(rank.logs) - len(rank.quiet) for rank in record.ranks]
    return [(rank.rank, count - share, _last_lines(rank, share))
            for rank, count, share in zip(record.ranks, counts, _shares(counts, limit)) if share]


def tail_lines(record: RunRecord, limit: int = TEXT_LINES) -> list[tuple[str, str]]:
    """``output_tail`` as the text view prints lines, ``[rank r] line``, with where the left-out ones are.

    A many-rank run's (``grouping.is_grouped``): each rank's last ``limit`` lines, every distinct
    line once, labelled with the ranks that printed it (``[ranks 0–10, 12–15] line``), ``limit``
    distinct lines in all."""
    if grouping.is_grouped(record):
        blocks, left_out = grouping.grouped_lines(record, per_rank=limit, limit=limit)
        lines = [("stdout", f"... {left_out} earlier distinct line{'s' if left_out != 1 else ''} "
                            "in hvdmagic.last_run().logs")] if left_out else []
        for block in blocks:
            lines.extend((stream, f"[{block.name()}] {_ANSI.sub('', line)}") for stream, line in block.lines)
        return lines
    lines = []
    for rank, earlier, tail in output_tail(record, limit):
        if earlier:
            lines.append(("stdout", f"[rank {rank}] ... {earlier} earlier line{'s' if earlier != 1 else ''} "
                                    f"in hvdmagic.last_run().logs[{rank}]"))
        lines.extend((stream, f"[rank {rank}] {line}") for stream, line in tail)
    return lines


def _state_words(rank: RankRecord, reason: str = "") -> str:
    where = progress_text.where_it_ended(rank)
    state = f"{rank.state} {where}" if where else progress_text.row_state(rank)
    return f"{state}, {reason}" if reason else state


def summary(record: RunRecord) -> str:
    """Deterministic: each rank's final progress and state (a many-rank run's grouped, as
    ``grouping.rows`` groups them), the notes, rank 0's latest metrics."""
    lines = []
    if grouping.is_grouped(record):
        rows = [(group.name(record), group.progress(), group.slowest, group.reason)
                for group in grouping.rows(record)]
    else:
        rows = [(progress_text.row_name(record, rank.rank), progress_text.progress_summary(rank), rank, "")
                for rank in record.ranks]
    flagged = {flag.rank for flag in record.stragglers}
    if flagged:  # deterministic, unlike the live header's figures: who, not how much
        who = ", ".join(progress_text.row_name(record, rank) for rank in sorted(flagged))
        lines.append(f"{progress_text.STRAGGLER_SIGN} straggler: {who} (a step rate {progress_text.SLOWER_TEXT} "
                     "below the median; hvdmagic.last_run().stragglers has the figures)")
    lines.extend(notice.line() for notice in record.hang_notices)  # no clock in them: deterministic
    for name, progress, rank, reason in rows:
        state = _state_words(rank, reason)
        # The rank's own row, not a group's; a grouped view's straggler has one, named by its reason
        # (grouping.OWN_ROW), which says it already.
        own_row = name == progress_text.row_name(record, rank.rank) and not reason
        marker = f" [{progress_text.STRAGGLER_SIGN} straggler]" if own_row and rank.rank in flagged else ""
        if progress:
            lines.append(f"{name}: {progress} [{state}]{marker}")
        elif rank.state not in progress_text.UP or reason or marker:  # the headline says it
            lines.append(f"{name}: [{state}]{marker}")
    lines.extend(record.notes)
    latest = record.latest_metrics()
    if latest:
        step = max(step for step, _ in latest.values())
        values = "  ".join(f"{name}={value:.4g}" for name, (_, value) in sorted(latest.items()))
        lines.append(f"rank 0 metrics at step {step}: {values}")
    return "".join(line + "\n" for line in lines)


class Snapshot:
    """A run as it ended, for a notebook's saved output: ``display(Snapshot(record))``.

    ``compact``: the record of a run whose live widgets never showed; honoured only for a
    finished run without metrics or a timeline, which have nothing that needs more room.
    """

    def __init__(self, record: RunRecord, compact: bool = False):
        self.record = record
        self.compact = (compact and record.state in progress_text.UP and not len(record.history)
                        and not record.timeline)

    # -- text ---------------------------------------------------------------
    def headline(self) -> str:
        record = self.record
        state = "failed (see the error below)" if record.state == "failed" else progress_text.state_text(record.state)
        return f"{record.command} {progress_text.size_text(record)}: {state}"

    def text(self, output: bool = True) -> str:
        """The headline; with ``output``, the last lines of the ranks' output as the text view
        printed them; then what the text view prints at the end of a run. No timings, rates or
        hosts: it changes between two runs only where the ranks' own output does."""
        lines = "".join(line + "\n" for _, line in tail_lines(self.record)) if output else ""
        return self.headline() + "\n" + lines + summary(self.record)

    def __repr__(self) -> str:
        return self.text().rstrip("\n")

    # -- HTML ---------------------------------------------------------------
    def _repr_html_(self) -> str:
        if self.compact:
            return self._compact_html()
        record = self.record
        parts = [self._header(), self._ranks()]
        if record.hang_notices:
            parts.append(_section("hang notices", hang_notices_html(record)))
        metrics = charts.metrics_html(charts.series_by_metric(record.rank0_series), scale=record.chart_scales)
        if metrics:
            parts.append(_section("metrics (rank 0)", metrics))
        notes = self._notes()
        if notes:
            parts.append(_section("notes", notes))
        logs = self._logs()
        if logs:
            parts.append(_section("logs", logs))
        # The text twin, for the exports that take the HTML: hidden wherever HTML is shown
        # (JupyterLab's sanitizer keeps the attribute), first in a Markdown file's text.
        text = f'<pre class="hvdmagic-text" hidden style="display:none">{html.escape(self.text())}</pre>'
        return _no_blank_lines(
            f'<div class="hvdmagic-snapshot" data-state="{html.escape(record.state)}" '
            f'style="font-family:{html.escape(_FONT)};font-size:13px;line-height:1.4;color:#222;'
            f'border:1px solid #e0e0e0;border-radius:4px;padding:8px 10px;max-width:1100px">'
            + text + "".join(parts) + "</div>")

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        bundle = {"text/plain": self.text(), "text/html": self._repr_html_()}
        if include:
            bundle = {k: v for k, v in bundle.items() if k in include}
        if exclude:
            bundle = {k: v for k, v in bundle.items() if k not in exclude}
        return bundle

    def _compact_html(self) -> str:
        """One line, then the output's last lines and any progress or notes, with no frame."""
        record = self.record
        header = (f'<div class="hvdmagic-snapshot-header" style="white-space:nowrap;overflow:hidden;'
                  f'text-overflow:ellipsis"><b>{html.escape(record.command)}</b> '
                  f"{html.escape(progress_text.size_text(record))}: "
                  f'<span class="hvdmagic-state" style="color:{STATE_COLOURS[record.state]};font-weight:600">'
                  f"{html.escape(record.state)}</span> in {_elapsed(record.elapsed)}</div>")
        pre = (f"margin:2px 0 0;padding:0;background:none;font-family:{_MONO};font-size:12px;"
               "line-height:1.35;white-space:pre-wrap;word-break:break-word")
        parts = [header]
        lines = tail_lines(record)
        if lines:
            parts.append(f'<pre class="hvdmagic-tail" style="{pre}">{_lines(lines)}</pre>')
        rest = summary(record)
        if rest:
            parts.append(f'<pre class="hvdmagic-summary" style="{pre};color:#555">{html.escape(rest.rstrip())}</pre>')
        return _no_blank_lines(
            f'<div class="hvdmagic-snapshot hvdmagic-compact" data-state="{html.escape(record.state)}" '
            f'title="every line, timing and result: hvdmagic.last_run()" '
            f'style="font-family:{html.escape(_FONT)};font-size:13px;line-height:1.4;color:#222">'
            + "".join(parts) + "</div>")

    def _header(self) -> str:
        record = self.record
        colour = STATE_COLOURS.get(record.state, "#888")
        state = (f'<span class="hvdmagic-state" style="color:{colour};font-weight:600">'
                 f"{html.escape(progress_text.state_text(record.state).split(':')[0])}</span>")
        if record.state == "failed":
            state += f'<span style="color:{colour}">: see the error below</span>'
        items = [f"<b>{html.escape(record.command)}</b>", state]
        items += [progress_text.elapsed_text(record.elapsed), html.escape(progress_text.size_text(record))]
        if record.job_group:
            items.append('<span style="white-space:nowrap">Spark job group '
                         f'<code>{html.escape(record.job_group)}</code></span>')
        header = ('<div class="hvdmagic-snapshot-header" style="font-size:14px;margin-bottom:4px">'
                  + " · ".join(items) + "</div>")
        stages = record.timings.get("stages") or {}
        if stages:
            steps = " → ".join(f"{html.escape(name)} {_seconds(seconds)}" for name, seconds in stages.items())
            header += f'<div class="hvdmagic-stages" style="font-size:11px;color:#777;margin-bottom:4px">{steps}</div>'
        if lagging := progress_text.stragglers_line(record, live=False):
            header += (f'<div class="hvdmagic-stragglers" style="font-size:12px;color:#d62728;margin-bottom:4px">'
                       f"{html.escape(lagging)}</div>")
        return header

    def _ranks(self) -> str:
        """A row per rank; a many-rank run's grouped rows, with every rank's row one click away."""
        record = self.record
        if not grouping.is_grouped(record):
            return _rank_table("hvdmagic-ranks", [
                _rank_row(rank, progress_text.row_name(record, rank.rank), html.escape(rank.host),
                          progress_text.progress_summary(rank)) for rank in record.ranks])
        rows = []
        for group in grouping.rows(record):
            hosts = group.hosts()
            host = html.escape(hosts[0]) if len(hosts) == 1 else f"{len(hosts)} hosts" if hosts else ""
            rows.append(_rank_row(group.slowest, group.name(record), host, group.progress(), group.reason,
                                  ranks=group.ranks, exit_codes={m.exit_code for m in group.members}))
        every = _rank_table("hvdmagic-ranks hvdmagic-every-rank", [
            _rank_row(rank, progress_text.row_name(record, rank.rank), html.escape(rank.host),
                      progress_text.progress_summary(rank)) for rank in record.ranks])
        return (_rank_table("hvdmagic-ranks hvdmagic-grouped", rows)
                + f'<details class="hvdmagic-every-rank" style="margin:0 0 6px"><summary style="font-size:12px;'
                  f'cursor:pointer">every {"task" if record.elastic else "rank"} ({record.np})</summary>'
                  f"{every}</details>")

    def _notes(self) -> str:
        record = self.record
        notes = list(record.notes)
        if shipped := record.shipping_note():
            notes.append(shipped)
        if record.timeline:
            try:
                from hvdmagic.kernel.timeline import describe

                notes.append(describe(record.timeline))
            except (OSError, ValueError, KeyError, TypeError):
                notes.append(f"Horovod Timeline: {record.timeline}")
        return "".join(f'<pre class="hvdmagic-note" style="margin:2px 0;white-space:pre-wrap;font-family:{_MONO};'
                       f'font-size:12px">{html.escape(note)}</pre>' for note in notes)

    def _logs(self) -> str:
        """Each rank's last lines; a many-rank run's distinct lines once with their rank lists,
        and each rank's own log one click away."""
        record = self.record
        if not grouping.is_grouped(record):
            return self._rank_logs()
        blocks, left_out = grouping.grouped_lines(record, per_rank=TAIL_LINES, limit=GROUPED_LINES)
        if not blocks and not any(rank.logs for rank in record.ranks):  # one line, not a "no output" per rank
            noun = "task" if record.elastic else "rank"
            return f'<div style="font-size:11px;color:#888;margin:2px 0">no {noun} printed anything</div>'
        if not blocks:
            return self._rank_logs()
        caption = (f"each rank's last {TAIL_LINES} lines, every distinct line once"
                   + (f"; {left_out} earlier distinct lines left out" if left_out else ""))
        parts = [f'<div style="font-size:11px;color:#888;margin:2px 0">{caption}</div>']
        for block in blocks:
            parts.append(f'<div class="hvdmagic-log-group" data-ranks="{" ".join(map(str, block.ranks))}" '
                         f'style="margin:4px 0"><div style="font-size:12px"><b>{html.escape(block.name())}</b></div>'
                         f'<pre style="{_PRE}">{_lines(block.lines)}</pre></div>')
        failed = [rank for rank in record.ranks if rank.state == "failed"]
        if failed:  # what a failed rank printed last says why: its own block, outside the fold
            parts.append(self._rank_logs(failed))
        noun = "task" if record.elastic else "rank"
        parts.append(f'<details class="hvdmagic-every-log" style="margin-top:4px"><summary style="font-size:12px;'
                     f'cursor:pointer">each {noun}’s log ({record.np})</summary>{self._rank_logs()}</details>')
        return "".join(parts)

    def _rank_logs(self, ranks: list[RankRecord] | None = None) -> str:
        """Each rank's log block (of ``ranks``; by default every rank's)."""
        blocks = []
        pre = _PRE
        for rank in self.record.ranks if ranks is None else ranks:
            logs, notices = rank.logs, []
            if rank.state != "failed":  # a failed rank's notices may say why: shown among its lines
                logs = [(stream, line) for stream, line in rank.logs if not is_startup_noise(line)]
                notices = [line for stream, line in rank.logs if is_startup_noise(line)]
            count = len(logs)
            where = f"hvdmagic.last_run().logs[{rank.rank}]"
            host = f" @ {html.escape(rank.host)}" if rank.host else ""
            name = progress_text.row_name(self.record, rank.rank)
            folded = ""
            if notices:
                folded = (f'<details class="hvdmagic-notices" style="margin-top:2px"><summary style="font-size:11px;'
                          f'color:#888;cursor:pointer">framework notices ({len(notices)})</summary>'
                          f'<pre style="{pre};color:#888">{html.escape(chr(10).join(notices))}</pre></details>')
            if not count:
                blocks.append(f'<div class="hvdmagic-log" data-rank="{rank.rank}" style="margin:4px 0">'
                              f'<span style="font-size:12px"><b>{name}</b>{host}</span> '
                              f'<span style="font-size:11px;color:#888">no output</span>{folded}</div>')
                continue
            tail = _lines(logs[-TAIL_LINES:])
            shown = min(count, TAIL_LINES)
            caption = (f"{count} lines, the last {shown} below; every line is in <code>{where}</code>"
                       if count > shown else f"{count} line{'s' if count != 1 else ''}")
            block = (f'<div class="hvdmagic-log" data-rank="{rank.rank}" style="margin:6px 0">'
                     f'<div style="font-size:12px"><b>{name}</b>{host} '
                     f'<span style="font-size:11px;color:#888">{caption}</span></div>'
                     f'<pre style="{pre}">{tail}</pre>')
            if count > TAIL_LINES:
                longer = min(count, LOG_LINES)
                older = (f'<div style="font-size:11px;color:#888;margin:2px 0">the last {longer} of {count} lines; '
                         f"every line is in <code>{where}</code> while this kernel lives</div>"
                         if count > longer else "")
                block += (f'<details style="margin-top:2px"><summary style="font-size:12px;cursor:pointer">'
                          f"{name}: {count} lines</summary>{older}"
                          f'<pre style="{pre};max-height:400px;overflow-y:auto">{_lines(logs[-LOG_LINES:])}'
                          f"</pre></details>")
            blocks.append(block + folded + "</div>")
        return "".join(blocks)


_CELL = "padding:2px 10px 2px 0;text-align:left;white-space:nowrap;vertical-align:middle"


def _rank_row(rank: RankRecord, name: str, host: str, progress: str, reason: str = "", *,
              ranks: list[int] | None = None, exit_codes: set | None = None) -> str:
    """A row of the ranks' table: one rank, or (``ranks``) a group that ``rank`` stands for."""
    colour = STATE_COLOURS.get(rank.state, "#888")
    fraction = _fraction(rank)
    bar = ""
    if fraction is not None:
        bar = (f'<div style="width:120px;height:6px;background-color:#eee;border-radius:3px">'
               f'<div style="width:{fraction * 100:.1f}%;height:6px;background-color:{colour};'
               f'border-radius:3px"></div></div>')
    state = html.escape(progress_text.row_state(rank))
    if where := progress_text.where_it_ended(rank):
        state += f' <span style="color:#888">{html.escape(where)}</span>'
    if reason:
        state += f' <span class="hvdmagic-reason" style="color:#b26b00">{html.escape(reason)}</span>'
    if ranks is None and (marker := progress_text.straggler_text(rank)):
        state += f' <span class="hvdmagic-straggler" style="color:#d62728;font-weight:600">{html.escape(marker)}</span>'
    codes = sorted(code for code in (exit_codes if exit_codes is not None else {rank.exit_code})
                    if code is not None)
    exit_code = ", ".join(map(str, codes))
    which = (f'data-rank="{rank.rank}"' if ranks is None else
             f'data-ranks="{" ".join(map(str, ranks))}" data-count="{len(ranks)}"')
    return (f'<tr class="hvdmagic-rank" {which}>'
            f'<td style="{_CELL};white-space:normal;max-width:260px"><b>{html.escape(name)}</b></td>'
            f'<td style="{_CELL}">{host}</td>'
            f'<td style="{_CELL};font-variant-numeric:tabular-nums">{html.escape(progress)}</td>'
            f'<td style="{_CELL}">{bar}</td>'
            f'<td style="{_CELL};color:{colour}">{state}</td>'
            f'<td style="{_CELL}">{exit_code}</td></tr>')


def _rank_table(classes: str, rows: list[str]) -> str:
    head = "".join(f'<th style="{_CELL}">{title}</th>'
                   for title in ("rank", "host", "progress", "", "state", "exit code"))
    return (f'<table class="{classes}" style="border-collapse:collapse;font-size:12px;margin:2px 0 6px">'
            f'<thead><tr style="border-bottom:1px solid #ddd">{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>")


def _lines(logs: list[tuple[str, str]]) -> str:
    out = []
    for stream, line in logs:
        text = html.escape(_ANSI.sub("", line))
        out.append(f'<span style="color:#b22">{text}</span>' if stream == "stderr" else text)
    return "\n".join(out)


_BLANK_LINE = re.compile(r"^[ \t]*$", re.MULTILINE)


def _no_blank_lines(markup: str) -> str:
    """``markup`` with an empty ``<span>`` on each blank line (an empty line a rank printed, in a
    ``<pre>``): a browser shows the line as before, and a Markdown renderer, which ends an HTML
    block at a blank line, keeps the whole snapshot one block of HTML."""
    return _BLANK_LINE.sub(lambda blank: blank.group() + "<span></span>", markup)


_CODE = re.compile(r"`([^`]*)`")


def hang_notices_html(record: RunRecord) -> str:
    """Horovod's stall reports, one amber line each, with how often Horovod repeated them
    (the snapshot's and the live dashboard's)."""
    out = []
    for notice in record.hang_notices:
        again = ""
        if notice.reports > 1:
            again = (f' <span style="color:#888">· reported {notice.reports} times over '
                     f"{progress_text.duration(notice.last_seen - notice.first_seen)}</span>")
        text = _CODE.sub(r"<code>\1</code>", html.escape(notice.line()))  # the tensor names, `as in Markdown`
        out.append(f'<div class="hvdmagic-hang" style="margin:2px 0;padding:2px 6px;border-left:3px solid #d98c00;'
                   f'background-color:#fff8e6;font-size:12px;white-space:pre-wrap">{text}{again}</div>')
    return "".join(out)


def _section(title: str, body: str) -> str:
    return (f'<div class="hvdmagic-section" style="margin-top:8px">'
            f'<div style="font-size:12px;font-weight:600;color:#555;border-bottom:1px solid #eee;'
            f'margin-bottom:4px;white-space:nowrap">{html.escape(title)}</div>{body}</div>')
