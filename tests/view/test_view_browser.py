"""The trajectory viewer in a real headless Chromium, opened from file:// and through --serve.

Runs are real (tests/view/runs.py: oracle episodes of the demo tasks; scripted tool-calling
episodes whose model text, reasoning and output carry HTML and script, escape sequences and bytes
that are not UTF-8; a record with a 1 MB output line). The page is checked through the DevTools
protocol: every episode is listed, filters and sorting work, an episode page shows its commands and
test verdicts, hostile output is inert text (and the same payload does run in a control page that
inserts it as HTML).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from et_hpc.text import visible
from view.runs import ANSI, BIG_LINE, PAYLOAD, PAYLOAD_IMG, PAYLOAD_SCRIPT

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
PWNED = "window.__etv_pwned !== undefined || document.title === 'pwned'"


@pytest.fixture(scope="module")
def site(view_runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site") / "viewer"
    r = subprocess.run(
        ET_HPC + ["view", str(view_runs["oracle"]), str(view_runs["hostile"]), "-o", str(out)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"open: {(out / 'index.html').as_uri()}" in r.stdout
    return out


def _ids(run: Path) -> set[str]:
    from et_hpc.runs.store import RunStore

    return set(RunStore(run).read(columns=["episode_id"]).column("episode_id").to_pylist())


def _rows(browser) -> list[dict]:
    return browser.eval(
        "[...document.querySelectorAll('tr.ep')].map(tr => ({id: tr.dataset.episode, cells: [...tr.cells].map(td => td.textContent)}))"
    )


def _open(browser, site: Path, fragment: str, ready: str) -> None:
    browser.goto(f"{(site / 'index.html').as_uri()}#{fragment}", ready)


RUN_READY = "document.querySelectorAll('tr.ep').length > 0 || document.getElementById('count')"
EPISODE_READY = "document.getElementById('transcript') !== null"


def test_self_contained_no_network(site: Path) -> None:
    page = (site / "index.html").read_text()
    data = [p.read_text() for p in (site / "data").rglob("*.js")]
    assert len(data) >= 3  # two run files and their detail chunks
    for text in [page, *data]:
        assert not re.search(r"(src|href)=[\"']?(https?:)?//", text), "the viewer must not load anything from the network"
    assert "fetch(" not in page and "XMLHttpRequest" not in page  # file:// refuses both


def test_every_episode_listed(browser, site: Path, view_runs: dict[str, Path]) -> None:
    for key, name in (("r0", "oracle"), ("r1", "hostile")):
        _open(browser, site, f"run={key}", RUN_READY)
        rows = _rows(browser)
        assert {r["id"] for r in rows} == _ids(view_runs[name]) and len(rows) == len(_ids(view_runs[name]))
    assert browser.eval("document.getElementById('plots').querySelectorAll('svg').length") == 4
    assert not browser.console, browser.console


def test_filters_and_sorting(browser, site: Path, view_runs: dict[str, Path]) -> None:
    from et_hpc.runs.store import RunStore

    table = RunStore(view_runs["hostile"]).read(columns=["episode_id", "task_id", "reward"]).to_pylist()
    _open(browser, site, "run=r1", RUN_READY)
    assert len(_rows(browser)) == 3
    # typing into the search box filters the table and lands in the address
    browser.eval("(() => { const q = document.querySelector('input[name=q]'); q.value = 'csv';q.dispatchEvent(new Event('input')); })()")
    rows = _rows(browser)
    assert [r["id"] for r in rows] == [t["episode_id"] for t in table if "csv" in t["task_id"]]
    assert "q=csv" in browser.eval("location.hash")
    # the result filter: only solved episodes
    browser.eval(
        "(() => { const q = document.querySelector('input[name=q]'); q.value = ''; q.dispatchEvent(new Event('input'));"
        "const s = document.querySelector('select[name=result]'); s.value = 'solved'; s.dispatchEvent(new Event('change')); })()"
    )
    solved = {t["episode_id"] for t in table if t["reward"] == 1.0}
    assert solved and {r["id"] for r in _rows(browser)} == solved
    # a filter given in the URL; then sorting by reward, high first
    _open(browser, site, "run=r1&result=unsolved", RUN_READY)
    assert {r["id"] for r in _rows(browser)} == {t["episode_id"] for t in table if t["reward"] == 0.0}
    _open(browser, site, "run=r1", RUN_READY)
    browser.eval("document.querySelector('th[data-col=reward]').click()")
    browser.eval("document.querySelector('th[data-col=reward]').click()")
    first = _rows(browser)[0]["id"]
    assert first in solved and "desc=1" in browser.eval("location.hash")


def test_episode_page_shows_commands_and_tests(browser, site: Path, view_runs: dict[str, Path]) -> None:
    from et_hpc.runs.store import RunStore

    rec = next(r for r in RunStore(view_runs["oracle"]).records() if r.task_id == "demo_csv_sum" and r.sample == 0)
    _open(browser, site, "run=r0", RUN_READY)
    browser.eval(f"document.querySelector('tr[data-episode=\"{rec.episode_id}\"] a').click()")
    browser.wait(EPISODE_READY)
    commands = browser.eval("[...document.querySelectorAll('pre.command')].map(p => p.textContent)")
    sent = [m["content"] for m in rec.messages if m["role"] == "assistant" and "<command>" in m["content"]]
    assert len(commands) == len(sent) == 1 and commands[0] in sent[0] and "awk" in commands[0]
    tests = browser.eval(
        "[...document.querySelectorAll('#tests tr[data-outcome]')].map(tr => [tr.cells[0].textContent, tr.dataset.outcome])"
    )
    assert tests == [[t.name, t.outcome] for t in rec.tests] and tests
    assert browser.eval("document.querySelector('[data-exit]').dataset.exit") == "0"
    # each turn's time: the model's wait on its label, the command's on its output's
    assert rec.turn_s and len(rec.turn_s) == rec.turns, rec.turn_s
    labels = browser.eval("[...document.querySelectorAll('#transcript .turn .label')].map(l => l.textContent)")
    model_s, exec_s = rec.turn_s[0]
    assert any(lb.startswith("turn 1: the model") and lb.endswith(f"{model_s:.2f} s") for lb in labels), labels
    assert any(lb.startswith("output") and lb.endswith(f"{exec_s:.2f} s") for lb in labels), labels
    timings = browser.eval("document.getElementById('timings').textContent")
    assert "score_s" in timings and "total_s" in timings
    assert "MB" in browser.eval("document.getElementById('facts').textContent")  # peak memory
    browser.eval("document.getElementById('back').click()")
    browser.wait("document.querySelectorAll('tr.ep').length === 8")


def test_hostile_output_is_inert(browser, site: Path, view_runs: dict[str, Path]) -> None:
    from et_hpc.runs.store import RunStore

    recs = {r.task_id: r for r in RunStore(view_runs["hostile"]).records()}
    hostile, big = recs["demo_hello_file"], recs["big_output"]
    assert PAYLOAD in json.dumps(hostile.messages, ensure_ascii=False).replace('\\"', '"')  # the payload is in the record
    _open(browser, site, f"run=r1&ep={hostile.episode_id}", EPISODE_READY)
    text = browser.eval("document.getElementById('transcript').textContent")
    assert PAYLOAD_SCRIPT in text and PAYLOAD_IMG in text  # shown, as text
    assert "\\udcff\\udcfe" in text  # the bytes that were not UTF-8, shown as escapes
    assert browser.eval("document.querySelectorAll('#main script, #main img, #main [onerror]').length") == 0
    assert browser.eval("document.querySelectorAll('pre.command').length") == 3
    assert browser.eval("[...document.querySelectorAll('[data-exit]')].map(e => e.dataset.exit)") == ["0", "1", "0"]
    assert browser.eval(PWNED) is False
    # the 1 MB line: folded, unfolds on request; escape sequences are shown, not interpreted
    _open(browser, site, f"run=r1&ep={big.episode_id}", EPISODE_READY)
    assert browser.eval("document.querySelector('.folded pre').textContent.length") <= 4000
    assert "reasoningI will print <b>a lot</b>" in browser.eval("document.querySelector('[data-turn=\"1\"]').textContent")
    browser.eval("document.querySelector('button.unfold').click()")
    assert browser.eval("document.querySelector('.folded pre').textContent.length") > BIG_LINE
    shown = visible(ANSI)  # the one sanitizer's escapes: \x1b[31mRED\x1b[0m as text
    assert shown != ANSI and "\\x1b[31m" in shown
    assert shown in browser.eval("document.querySelector('.folded pre').textContent")
    assert shown in browser.eval("document.getElementById('events').textContent")
    assert browser.eval("document.getElementById('events').textContent").count("<script>") == 1
    assert browser.eval(PWNED) is False


def _js(s: str) -> str:
    return json.dumps(s).replace("</", "<\\/")  # a string literal inside an inline script


def test_positive_control_payload_runs_as_html(browser, tmp_path: Path) -> None:
    """The same payloads do run when a page inserts them as HTML: the checks above can fail."""
    page = tmp_path / "control.html"
    page.write_text(
        "<!DOCTYPE html><title>control</title><div id=x></div><script>"
        f"const p = {_js(PAYLOAD_SCRIPT)}, q = {_js(PAYLOAD_IMG)};"
        "document.getElementById('x').append(document.createRange().createContextualFragment(p));"
        "window.__first = window.__etv_pwned;"
        "document.getElementById('x').innerHTML += q;</script>"
    )
    browser.goto(page.as_uri(), "document.readyState === 'complete'")
    assert browser.eval("window.__first") == "script"
    assert browser.wait("window.__etv_pwned === 'img' && document.title === 'pwned'")


def test_tokens_view_and_drift(browser, site: Path, view_runs: dict[str, Path]) -> None:
    from et_hpc.runs.store import RunStore

    recs = {r.task_id: r for r in RunStore(view_runs["hostile"]).records()}
    drifted, exact = recs["demo_hello_file"], recs["demo_csv_sum"]
    assert drifted.token_drift and exact.token_drift is None and exact.token_ids and exact.logprobs
    _open(browser, site, f"run=r1&ep={exact.episode_id}", "document.getElementById('tokens') !== null")
    assert browser.eval("document.getElementById('drift')") is None
    tok = browser.eval("[...document.querySelectorAll('[data-token-turn=\"0\"] .tok')].map(s => s.title)")
    assert len(tok) == len(exact.token_ids[0])
    assert tok[0] == f"id {exact.token_ids[0][0]} logprob {round(exact.logprobs[0][0], 4):g}"
    _open(browser, site, f"run=r1&ep={drifted.episode_id}", "document.getElementById('tokens') !== null")
    assert drifted.token_drift in browser.eval("document.getElementById('drift').textContent")
    turn = int(re.match(r"turn (\d+)", drifted.token_drift).group(1))
    assert browser.eval(f"document.querySelector('[data-token-turn=\"{turn}\"]').className").endswith("drift")


def test_screenshot(browser, site: Path, tmp_path: Path) -> None:
    _open(browser, site, "run=r0", RUN_READY)
    png = browser.screenshot(tmp_path / "run.png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width == 1280 and height > 500 and len(png) > 20_000  # a rendered page, not a blank one


def test_serve(browser, view_runs: dict[str, Path], tmp_path: Path) -> None:
    p = subprocess.Popen(
        ET_HPC + ["view", str(view_runs["oracle"]), "-o", str(tmp_path / "v"), "--serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        url = None
        for line in p.stdout:
            m = re.search(r"serving on (http://127\.0\.0\.1:\d+/)", line)
            if m:
                url = m.group(1)
                break
        assert url, "no URL printed"
        with urllib.request.urlopen(url + "data/r0.js", timeout=10) as r:
            assert r.status == 200 and r.read().startswith(b"ETV.run(")
        browser.goto(url + "index.html#run=r0", RUN_READY)
        assert {r["id"] for r in _rows(browser)} == _ids(view_runs["oracle"])
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=20) == 0


@pytest.mark.parametrize("case", ["missing", "out-is-file", "out-not-ours"])
def test_bad_input_one_line_exit_2(view_runs: dict[str, Path], tmp_path: Path, case: str) -> None:
    run = str(view_runs["oracle"])
    if case == "missing":
        argv = ["view", str(tmp_path / "nope"), "-o", str(tmp_path / "o")]
    elif case == "out-is-file":
        (tmp_path / "f").write_text("x")
        argv = ["view", run, "-o", str(tmp_path / "f")]
    else:
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "notes.txt").write_text("mine")
        argv = ["view", run, "-o", str(tmp_path / "d")]
    r = subprocess.run(ET_HPC + argv, capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    if case == "out-not-ours":
        assert (tmp_path / "d" / "notes.txt").read_text() == "mine"


def test_pages_and_status_filter(browser, tmp_path: Path) -> None:
    """250 episodes (written through the store API, 1 in 10 an infrastructure error): 100 a page,
    every episode on some page, and the status filter."""
    from et_hpc.record import EpisodeRecord
    from et_hpc.runs.store import RunStore

    recs = [
        EpisodeRecord(
            run_name="many",
            task_id=f"task_{i // 5:03d}",
            sample=i % 5,
            status="infra_error" if i % 10 == 3 else "ok",
            reward=None if i % 10 == 3 else float(i % 2),
            error="stand-in failure" if i % 10 == 3 else None,
            turns=i % 7,
        )
        for i in range(250)
    ]
    RunStore(tmp_path / "many").write(recs)
    out = tmp_path / "v"
    r = subprocess.run(ET_HPC + ["view", str(tmp_path / "many"), "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    _open(browser, out, "run=r0", RUN_READY)
    seen = []
    for page in range(3):
        rows = _rows(browser)
        assert len(rows) == (100 if page < 2 else 50)
        seen += [r["id"] for r in rows]
        assert browser.eval("document.getElementById('count').textContent").startswith(f"{page * 100 + 1}-")
        browser.eval("document.querySelector('#pager button:last-child').click()")
    assert sorted(seen) == sorted(r.episode_id for r in recs)
    _open(browser, out, "run=r0&status=infra_error", RUN_READY)
    assert {r["id"] for r in _rows(browser)} == {r.episode_id for r in recs if r.status == "infra_error"}
    assert all(r["cells"][7] == "stand-in failure" for r in _rows(browser))  # the error, where a note would be
