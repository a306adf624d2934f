"""A small DevTools-protocol client for headless Chromium (Debian's ``chromium``), for the viewer tests.

Chromium starts with ``--remote-debugging-port=0`` and a throw-away profile; the port it picked is
read from ``DevToolsActivePort`` in that profile, and the one page target is driven over its
websocket: navigate, evaluate JavaScript (values returned by value), take a screenshot.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import urllib.request
from pathlib import Path

from websockets.sync.client import connect

from helpers import until

FLAGS = [
    "--headless",
    "--disable-gpu",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-sync",
    "--mute-audio",
    "--window-size=1280,900",
    "--remote-allow-origins=*",
]


def _sandbox_flags(profile: Path) -> list[str]:
    """``[]`` when Chromium's sandbox works for this user here, else ``["--no-sandbox"]`` (containers
    without user namespaces)."""
    r = subprocess.run(
        ["chromium", *FLAGS, f"--user-data-dir={profile}", "--dump-dom", "about:blank"], capture_output=True, text=True, timeout=120
    )
    shutil.rmtree(profile, ignore_errors=True)
    return [] if "<html" in r.stdout else ["--no-sandbox"]


class Browser:
    def __init__(self, workdir: Path) -> None:
        self.profile = workdir / "profile"
        extra = _sandbox_flags(workdir / "probe-profile")
        self.proc = subprocess.Popen(
            ["chromium", *FLAGS, *extra, f"--user-data-dir={self.profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=open(workdir / "chromium.log", "wb"),
        )
        port_file = self.profile / "DevToolsActivePort"
        until("chromium's DevTools port", lambda: port_file.exists() and port_file.read_text().strip(), 60, 0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.loads(r.read()) if t["type"] == "page")
        self._conn = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=20)
        self.ws = self._conn.__enter__()
        self._ids = itertools.count(1)
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.console: list[str] = []

    def call(self, method: str, **params):
        i = next(self._ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("method") == "Runtime.exceptionThrown":
                self.console.append(json.dumps(msg["params"]["exceptionDetails"])[:500])
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def eval(self, expr: str):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr[:80]}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def goto(self, url: str, ready: str = "document.readyState === 'complete'", timeout_s: float = 30) -> None:
        """Open ``url`` (a fresh page load, also for a new #hash) and wait until ``ready`` is true."""
        self.call("Page.navigate", url="about:blank")
        until("about:blank", lambda: self.eval("location.href") == "about:blank", 10, 0.05)
        self.call("Page.navigate", url=url)
        self.wait(ready, timeout_s)

    def wait(self, expr: str, timeout_s: float = 30):
        return until(
            f"the page: {expr}",
            lambda: self.eval(f"(() => {{ try {{ return {expr}; }} catch (e) {{ return false; }} }})()"),
            timeout_s,
            0.05,
        )

    def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(data)
        return data

    def close(self) -> None:
        try:
            self._conn.__exit__(None, None, None)
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
