"""The reviewer's pages, opened from disk in real headless Chromium (Debian's
chromium-headless-shell driven by Playwright) and used the way a reviewer uses them.

Every page is checked to have asked for nothing but its own file and to have logged no
console error. With ``SFA_RD2H_SCREENSHOTS=1`` the tests also write the README's pictures to
``diagrams/review/``.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sfa_rd2h.runtime.tools.cli import main
from sfa_rd2h.spec import invariants
from sfa_rd2h.statemachines.snapshot import dumps, export_spec

REPO = Path(__file__).resolve().parent.parent
PINNED = REPO / "tests" / "data" / "mutant_counterexamples.json"
SHOTS = REPO / "diagrams" / "review"
CHROMIUM = Path("/usr/lib/chromium/chromium-headless-shell")
# Chromium as root here: no sandbox (Playwright adds it as root) and nothing that phones home.
ARGS = ["--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--no-first-run", "--no-sandbox"]


def _missing(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI must run the browser tests (bash .ci/setup installs it)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (pip install '.[dev]')")
    if not CHROMIUM.exists():
        _missing(f"no {CHROMIUM} (apt-get install chromium-headless-shell)")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield b
        b.close()


class Opened:
    """A page opened from disk that records every request and console error."""

    def __init__(self, browser, path: Path) -> None:
        self.context = browser.new_context(viewport={"width": 1500, "height": 1000})
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(path.resolve().as_uri())

    def _route(self, route) -> None:
        url = route.request.url
        self.requests.append(url)
        if url.startswith("file:"):
            route.continue_()
        else:
            route.abort()

    def close(self, shot: str | None = None) -> None:
        if shot and os.environ.get("SFA_RD2H_SCREENSHOTS"):
            SHOTS.mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(SHOTS / shot))
        try:
            assert [u for u in self.requests if not u.startswith("file:")] == []
            assert len(self.requests) == 1  # the page itself: everything else is inline
            assert self.errors == []
        finally:
            self.context.close()


def _changed_snapshot() -> dict:
    new = copy.deepcopy(export_spec())
    rows = new["machines"]["prefill_slot"]["transitions"]
    rows[0]["rules"] = [*rows[0]["rules"], "S2"]
    new["invariants"]["S1"]["text"] += " Evicted slots count as written."
    return new


def test_review_shows_the_rules_of_a_changed_transition(browser, tmp_path):  # S1
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(dumps(export_spec()))
    new.write_text(dumps(_changed_snapshot()))
    out = tmp_path / "review.html"
    assert main(["review", str(old), str(new), "--html", str(out)]) == 0
    view = Opened(browser, out)
    page = view.page
    edge = page.locator("#machine-prefill_slot g.row.changed")
    assert edge.count() == 1
    edge.click()
    rule = page.locator("#details .rule[data-rule='S1']")
    assert invariants.BY_ID["S1"].text.split(".")[0] in rule.locator(".rule-text").inner_text()
    assert rule.locator(".rule-text ins").inner_text() == "Evicted slots count as written."
    assert "check_s1_no_overwrite_while_read" in rule.inner_text()
    assert "ack_from_any_reader" in rule.inner_text()
    assert page.locator("#details .rule[data-rule='S2']").count() == 1
    assert "(S1, S2)" in page.locator("#details .row-detail").inner_text()
    view.close("review.png")


def test_review_of_an_unchanged_spec_says_so(browser, tmp_path, capsys):
    snap = tmp_path / "snap.json"
    snap.write_text(dumps(export_spec()))
    out = tmp_path / "same.html"
    assert main(["review", str(snap), str(snap), "--html", str(out), "--markdown"]) == 0
    assert "No protocol changes." in capsys.readouterr().out
    view = Opened(browser, out)
    assert "No protocol changes" in view.page.locator("#unchanged").inner_text()
    assert view.page.locator("g.row.added, g.row.removed, g.row.changed").count() == 0
    view.close()


def test_review_markdown_lists_changes_with_rule_ids(tmp_path, capsys):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(dumps(export_spec()))
    new.write_text(dumps(_changed_snapshot()))
    assert main(["review", str(old), str(new), "--markdown"]) == 0
    text = capsys.readouterr().out
    assert "- changed `free --begin_write / take_owner --> writing (S1, S2)`" in text
    assert "- changed **S1**:" in text


def test_review_and_explain_refuse_what_they_cannot_read(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a snapshot"}))
    assert main(["review", str(bad), str(bad), "--markdown"]) == 2
    assert "not a spec snapshot" in capsys.readouterr().err
    assert main(["explain", str(PINNED), "--html", str(tmp_path / "x.html")]) == 2
    assert "--bug NAME" in capsys.readouterr().err
    assert main(["explain", str(PINNED), "--bug", "nope", "--html", str(tmp_path / "x.html")]) == 2
    assert "no counterexample of 'nope'" in capsys.readouterr().err


def test_explain_shows_the_broken_invariant_of_a_pinned_counterexample(browser, tmp_path):
    # S1, S5: the seeded bug ack_from_any_reader frees the slot on a duplicated reply
    out = tmp_path / "explain.html"
    assert main(["explain", str(PINNED), "--bug", "ack_from_any_reader", "--html",
                 str(out)]) == 0
    view = Opened(browser, out)
    page = view.page
    page.keyboard.press("End")
    total = len(json.loads(page.locator("#page-data").text_content())["steps"])
    assert page.locator("body").get_attribute("data-step") == str(total - 1)
    assert page.locator("#failure.here").count() == 1
    assert page.locator("#broken-rule .rule-id").inner_text() == "S1"
    assert page.locator("#broken-rule .rule-text").inner_text() == invariants.BY_ID["S1"].text
    assert "S1, S5" in page.locator("#bug").inner_text()
    assert "S1 violated" in page.locator("#seen").inner_text()
    slot = page.locator("#instance-table tr[data-instance='prefill0/prefill_slot[main@0x1000]']")
    # the duplicated READ_DONE freed the slot while D1 had not replied
    assert slot.locator("td.state").inner_text() == "free"
    card = page.locator(".instance[data-instance='prefill0/prefill_slot[main@0x1000]']")
    assert card.locator("g.state.current title").text_content() == "free"
    page.keyboard.press("ArrowLeft")
    assert page.locator("#failure.here").count() == 0
    assert card.locator("g.row.fired").count() == 1  # the reply_done that freed it
    page.keyboard.press("ArrowRight")
    view.close("explain_counterexample.png")


@pytest.fixture(scope="module")
def demo_traces(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("demo") / "traces"
    out = subprocess.run([sys.executable, "-m", "sfa_rd2h.runtime.tools.cli", "demo",
                          "--p-tp", "2", "--d-tp", "1", "--layers", "2", "--slots", "1",
                          "--requests", "1", "--quiet", "--trace-dir", str(folder)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return folder


def test_explain_steps_a_real_demo_trace(browser, tmp_path, demo_traces):
    out = tmp_path / "trace.html"
    assert main(["explain", str(demo_traces), "--html", str(out)]) == 0
    records = [(n, json.loads(line)) for n, line in
               enumerate((demo_traces / "prefill0.jsonl").read_text().splitlines(), 1)]
    moves = [(n, r) for n, r in records if r.get("k") == "tr" and r["m"] == "prefill_slot"
             and r["ev"] != "start"]
    line, rec = moves[len(moves) // 2]  # a slot transition in the middle of the run
    view = Opened(browser, out)
    page = view.page
    assert "valid" in page.locator("#verdict").inner_text()
    steps = len(json.loads(page.locator("#page-data").text_content())["steps"])
    target = f"prefill0.jsonl:{line}"
    for _ in range(steps):
        if page.locator("#step-where").inner_text() == target:
            break
        page.keyboard.press("ArrowRight")
    assert page.locator("#step-where").inner_text() == target
    inst = f"prefill0/prefill_slot[{rec['key']}]"
    card = page.locator(f".instance[data-instance='{inst}']")
    assert card.locator(".inst-state").inner_text() == rec["dst"]
    assert card.locator("g.state.current title").text_content() == rec["dst"]
    assert card.locator("g.row.fired").count() == 1
    assert page.locator(f"#instance-table tr[data-instance='{inst}'] td.state").inner_text() \
        == rec["dst"]
    view.close("explain_trace.png")


def test_check_writes_a_counterexample_explain_replays(tmp_path, monkeypatch, capsys):  # C4
    from sfa_rd2h.model_check import checker, mutants
    from sfa_rd2h.runtime.tools.review.explain_page import explain_data

    real = checker.run_check
    monkeypatch.setattr(checker, "run_check", lambda budget, seed_value, **kw: real(
        budget, seed_value, prefill_cls=mutants.NotifyBeforeLanded, **kw))
    path = tmp_path / "cx.json"
    assert main(["check", "--budget", "20", "--quiet", "--counterexample", str(path)]) == 1
    entry = json.loads(path.read_text())
    assert entry["bug"] is None and entry["ops"] and "C4 violated" in entry["error"]
    # check names no bug (it ran the cores it was given); naming the core that ran replays
    # the failure, which is the page's last step
    entry["bug"] = "notify_before_landed"
    path.write_text(json.dumps(entry))
    data = explain_data(path)
    assert data["failure"]["rule_id"] == "C4"
    assert data["failure"]["step"] == len(data["steps"]) - 1
