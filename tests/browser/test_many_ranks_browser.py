"""Many ranks in JupyterLab: 12 and 64 local ranks as grouped rows, every rank one click away.

Each run is live long enough to be seen grouped: the 12-rank run has a slow rank 7, which
keeps a row of its own ("slowest") while the others share one; the 64-rank run ends with
rank 40 failing after the others finished, so its snapshot has two rows and rank 40's log
outside the fold. Screenshots under artifacts/screenshots/: many-12-live.png,
many-12-every-rank.png, many-12-finished.png, many-64-live.png, many-64-finished.png,
many-64-every-rank.png.
"""

from __future__ import annotations

import json
import re

import pytest
from test_browser import (  # noqa: F401 (lab and browser are the fixtures this module shares)
    DASHBOARD,
    LOAD_CELL,
    SCREENSHOTS,
    SNAPSHOT,
    browser,
    cell_js,
    lab,
    new_page,
    open_notebook,
    run_all_cells,
    shut_down_kernels,
    wait_for,
    wait_for_snapshot,
    wait_until_idle,
    write_notebook,
)

pytestmark = pytest.mark.browser

CELL = """\
%%horovod --np -{np}
import os, time, hvdmagic
rank = int(os.environ["HOROVOD_RANK"])
print("loading shard", flush=True)
for step in hvdmagic.track(range({steps}), desc="train"):
    time.sleep({pace})
    if step % 20 == 0:
        print(f"step {{step}}", flush=True)
print(f"rank {{rank}} done", flush=True)
{end}"""
TWELVE = CELL.format(np=12, steps=120, pace="0.15 if rank == 7 else 0.1", end="")
SIXTY_FOUR = CELL.format(np=64, steps=80, pace="0.1", end="""\
# Rank 40 fails once every other rank has ended: they stay finished. Each leaves its pid in the run's
# folder; rank 40 waits (a deadline, not a guess) until all 63 are there and none of them runs.
folder = os.path.join(os.environ.get("TMPDIR", "/tmp"), "hvdmagic-ranks-" + os.environ["HVDMAGIC_JOB_ID"])
os.makedirs(folder, exist_ok=True)
if rank != 40:
    open(os.path.join(folder, str(os.getpid())), "w").close()
else:
    def running(pid):
        try:
            return open(f"/proc/{pid}/stat").read().split()[2] != "Z"  # a zombie has ended too
        except FileNotFoundError:
            return False
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        pids = [int(name) for name in os.listdir(folder)]
        if len(pids) == 63 and not any(running(pid) for pid in pids):
            break
        time.sleep(0.1)
    raise ValueError("rank 40 found a bad shard")
""")
GROUP_ROWS = f"{DASHBOARD} .hvdmagic-rank"


def _expand(ranks: str) -> list[int]:
    """"0–10, 12" -> [0, ..., 10, 12]."""
    out = []
    for part in filter(None, (p.strip() for p in ranks.split(","))):
        first, _, last = part.partition("–")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def _rows_naming_every_rank_once(index: int, ranks: int) -> str:
    """The live dashboard's row labels in cell ``index`` once they name each of ``ranks`` ranks exactly once.

    A refresh redraws the rows' widgets one comm message at a time, so while the slowest rank changes
    the page can read the group row's new label beside the slowest row's old one for as long as the
    messages between them take. What a user sees is the rows between refreshes; a product that named a
    rank twice there never matches, and the wait fails."""
    return cell_js(index, f"""(() => {{
        const labels = Array.from(cell?.querySelectorAll({json.dumps(GROUP_ROWS)}) || [],
                                  row => row.innerText.split('\\n')[0]);
        const named = labels.flatMap(label => {{
            const match = /^ranks? ([\\d–, ]+)/.exec(label);
            if (!match) return [NaN];
            return match[1].split(',').map(part => part.trim()).filter(Boolean).flatMap(part => {{
                const [first, last] = part.split('–').map(Number);
                return Array.from({{length: (last ?? first) - first + 1}}, (_, i) => first + i);
            }});
        }});
        return named.length === {ranks} && new Set(named).size === {ranks} && labels;
    }})()""")


@pytest.mark.timeout(600)
def test_twelve_and_sixty_four_ranks_are_grouped_rows_with_every_rank_one_click_away(lab, browser):  # noqa: F811
    path = write_notebook(lab, "many-ranks.ipynb", LOAD_CELL, TWELVE, SIXTY_FOUR)
    seen: dict = {}
    try:
        with new_page(browser, "many-ranks") as page:
            open_notebook(page, lab, path.name)
            page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current").click()
            run_all_cells(page)
            # 12 ranks: rank 7 is slower, so it has a row of its own while the other eleven share one.
            seen["live12"] = wait_for(page, cell_js(1, f"""(() => {{
                    const rows = Array.from(cell?.querySelectorAll({json.dumps(GROUP_ROWS)}) || [],
                                            row => row.innerText.replace(/\\s+/g, ' '));
                    return rows.length === 2 && /ranks 0–6, 8–11/.test(rows[0]) && /rank 7 slowest/.test(rows[1])
                        && /\\d+–\\d+\\/120/.test(rows[0]) && rows;  // the steps column: the group's range
                }})()"""), timeout=150, failure="12 ranks did not show as a group row and rank 7's own slowest row")
            page.locator(f"{DASHBOARD}").first.evaluate("e => e.scrollIntoView({block: 'start'})")
            page.screenshot(path=SCREENSHOTS / "many-12-live.png")
            page.locator(f"{DASHBOARD} .hvdmagic-every-rank .jupyter-widget-Collapse-header, "
                         f"{DASHBOARD} .hvdmagic-every-rank .p-Collapse-header, "
                         f"{DASHBOARD} .hvdmagic-every-rank .lm-Collapse-header").first.click()
            seen["every12"] = wait_for(page, cell_js(1, """(() => {
                    const pre = cell?.querySelector('.hvdmagic-every-rank-rows');
                    const text = pre ? pre.innerText : '';
                    return text.split('\\n').filter(l => /^rank \\d+/.test(l)).length === 12 && text;
                })()"""), timeout=20, failure="The 'every rank (12)' fold did not show a row per rank")
            page.screenshot(path=SCREENSHOTS / "many-12-every-rank.png")
            wait_for_snapshot(page, 1, timeout=120, what="The 12-rank run did not end")
            seen["snapshot12"] = page.locator(f"{SNAPSHOT} >> nth=0").inner_text()
            page.locator(f"{SNAPSHOT} >> nth=0").evaluate("e => e.scrollIntoView({block: 'start'})")
            page.screenshot(path=SCREENSHOTS / "many-12-finished.png")

            # 64 ranks: live, grouped; then rank 40 fails after the others finished.
            seen["live64"] = wait_for(page, cell_js(2, f"""(() => {{
                    const rows = Array.from(cell?.querySelectorAll({json.dumps(GROUP_ROWS)}) || []);
                    const bars = cell?.querySelectorAll("{DASHBOARD} .hvdmagic-rank .progress-bar") || [];
                    const moving = Array.from(bars).some(b => parseFloat(b.style.width) > 10);
                    const texts = rows.map(r => r.innerText.replace(/\\s+/g, ' '));
                    return rows.length >= 1 && rows.length <= 4 && moving && /^ranks \\d/.test(texts[0]) && texts;
                }})()"""), timeout=240, failure="64 ranks did not show as at most 4 moving rows, a group's first")
            page.locator(f"{DASHBOARD}").first.evaluate("e => e.scrollIntoView({block: 'start'})")
            # What the screenshot shows: every row named by its own ranks, no two rows naming the same rank.
            seen["shot64"] = wait_for(page, _rows_naming_every_rank_once(2, 64), timeout=30,
                                      failure="The live rows never named each of the 64 ranks exactly once")
            page.screenshot(path=SCREENSHOTS / "many-64-live.png")
            seen["state64"] = wait_for_snapshot(page, 2, timeout=240, what="The 64-rank run did not end")
            wait_until_idle(page, timeout=60, what="After the 64-rank run")
            snapshot = page.locator(f"{SNAPSHOT} >> nth=1")
            seen["grouped64"] = snapshot.locator(".hvdmagic-grouped tr.hvdmagic-rank").all_inner_texts()
            seen["log64"] = snapshot.locator(".hvdmagic-log-group").all_inner_texts()
            seen["failed_log_outside"] = snapshot.evaluate(
                "e => Array.from(e.querySelectorAll(\".hvdmagic-log[data-rank='40']\"))"
                ".filter(l => !l.closest('details')).map(l => l.innerText)")
            snapshot.evaluate("e => e.scrollIntoView({block: 'start'})")
            page.screenshot(path=SCREENSHOTS / "many-64-finished.png")
            snapshot.locator("details.hvdmagic-every-rank > summary").click()
            seen["every64"] = snapshot.locator("details.hvdmagic-every-rank tr.hvdmagic-rank").count()
            snapshot.locator("details.hvdmagic-every-rank").scroll_into_view_if_needed()
            page.screenshot(path=SCREENSHOTS / "many-64-every-rank.png")
    finally:
        shut_down_kernels(lab)
    print(json.dumps(seen, indent=1, ensure_ascii=False))
    assert "ranks 0–11" in seen["snapshot12"] and "train 120/120" in seen["snapshot12"], seen["snapshot12"]
    assert seen["state64"] == "failed"
    named = [re.match(r"ranks? ([\d–, ]+)", label) for label in seen["shot64"]]
    assert all(named) and named[0].group(0).startswith("ranks "), seen["shot64"]
    ranks = [rank for match in named for rank in _expand(match.group(1))]
    assert len(ranks) == len(set(ranks)), f"a rank is named by two rows: {seen['shot64']}"
    rows = [" ".join(row.split()) for row in seen["grouped64"]]
    assert len(rows) == 2 and rows[0].startswith("ranks 0–39, 41–63") and "finished" in rows[0], rows
    assert rows[1].startswith("rank 40") and "failed" in rows[1], rows
    assert any("ranks 0–63" in block and "loading shard" in block for block in seen["log64"]), seen["log64"]
    assert any("rank {rank} done" in block for block in seen["log64"]), seen["log64"]
    outside = seen["failed_log_outside"]
    # Its traceback is the cell's error output; its own lines are shown outside the fold.
    assert len(outside) == 1 and "rank 40 done" in outside[0], f"rank 40's log, outside the fold: {outside}"
    assert seen["every64"] == 64
