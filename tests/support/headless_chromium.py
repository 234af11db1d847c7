"""Open a local page in a real headless Chromium over the DevTools protocol: console errors, requests, a screenshot.

Needs Debian's ``chromium`` (``apt-get install -y chromium``; ``ensure_browser`` installs it as root). The protocol client is
aiohttp's websocket, which Ray's ``default`` extra already installs.

As a script it writes the README's screenshot::

    .venv/bin/python tests/support/headless_chromium.py page.html docs/quality-gate.png
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
# What the page is asked for once loaded: every chart, and how many bars each one drew.
CHARTS_JS = """JSON.stringify(Array.from(document.querySelectorAll('svg.chart')).map(s => ({
  name: s.dataset.chart, bars: s.querySelectorAll('rect.bar').length,
  width: s.getBoundingClientRect().width, height: s.getBoundingClientRect().height})))"""


def find_browser() -> str | None:
    return next((p for p in (shutil.which(b) for b in BROWSERS) if p), None)


def ensure_browser() -> str | None:
    """A Chromium to drive: the one on PATH, or Debian's package installed once where this process may (root with
    apt-get, as on CI); None where neither is possible."""
    found = find_browser()
    if found or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {proc.stderr[-1000:]}")
    return find_browser()


@dataclass
class PageVisit:
    """What the browser saw: console errors and exceptions, every request made, the charts, a PNG."""

    console_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    charts: list[dict] = field(default_factory=list)
    title: str = ""
    screenshot: bytes = b""


def visit(page: Path, width: int = 1100, timeout_s: float = 60.0) -> PageVisit:
    """Load ``page`` (a local file) in headless Chromium and report what happened."""
    browser = find_browser()
    if browser is None:
        raise RuntimeError("no Chromium found; install it: apt-get install -y chromium")
    # Chromium may still be writing its profile when it exits: a cleanup race must not fail the visit.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen(
            [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--user-data-dir={profile}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            ws_url = _devtools_url(proc, timeout_s)
            return asyncio.run(asyncio.wait_for(_visit(ws_url, page.resolve().as_uri(), width), timeout_s))
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _devtools_url(proc: subprocess.Popen, timeout_s: float) -> str:
    import selectors
    import time

    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        if not sel.select(timeout=1.0):
            if proc.poll() is not None:
                break
            continue
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        m = re.search(r"DevTools listening on (ws://\S+)", line)
        if m:
            return m.group(1)
    raise RuntimeError("Chromium did not open its DevTools port: " + "".join(seen[-20:]))


async def _visit(browser_ws: str, url: str, width: int) -> PageVisit:
    import aiohttp

    out = PageVisit()
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(browser_ws, max_msg_size=0) as ws:
            ids = iter(range(1, 1_000_000))
            events: list[dict] = []

            async def call(method: str, params: dict | None = None, session_id: str | None = None) -> dict:
                msg_id = next(ids)
                msg = {"id": msg_id, "method": method, "params": params or {}}
                if session_id:
                    msg["sessionId"] = session_id
                await ws.send_str(json.dumps(msg))
                while True:
                    reply = json.loads((await ws.receive()).data)
                    if reply.get("id") == msg_id:
                        if "error" in reply:
                            raise RuntimeError(f"{method}: {reply['error']}")
                        return reply.get("result", {})
                    events.append(reply)

            target = await call("Target.createTarget", {"url": "about:blank"})
            sid = (await call("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}))["sessionId"]
            for domain in ("Page", "Runtime", "Log", "Network"):
                await call(f"{domain}.enable", session_id=sid)
            await call("Emulation.setDeviceMetricsOverride",
                       {"width": width, "height": 800, "deviceScaleFactor": 1, "mobile": False}, session_id=sid)
            await call("Page.navigate", {"url": url}, session_id=sid)
            while not any(e.get("method") == "Page.loadEventFired" for e in events):
                events.append(json.loads((await ws.receive()).data))
            await asyncio.sleep(0.5)  # late console messages
            out.charts = json.loads((await call("Runtime.evaluate", {"expression": CHARTS_JS, "returnByValue": True},
                                                session_id=sid))["result"]["value"])
            out.title = (await call("Runtime.evaluate", {"expression": "document.title", "returnByValue": True},
                                    session_id=sid))["result"]["value"]
            shot = await call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
                              session_id=sid)
            out.screenshot = base64.b64decode(shot["data"])
            for e in events:
                method, params = e.get("method"), e.get("params", {})
                if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                    out.console_errors.append(" ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
                elif method == "Runtime.exceptionThrown":
                    out.console_errors.append(params["exceptionDetails"].get("text", "exception"))
                elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                    out.console_errors.append(params["entry"]["text"])
                elif method == "Network.requestWillBeSent":
                    out.requests.append(params["request"]["url"])
    return out


if __name__ == "__main__":
    seen = visit(Path(sys.argv[1]))
    Path(sys.argv[2]).write_bytes(seen.screenshot)
    print(json.dumps({"console_errors": seen.console_errors, "requests": seen.requests, "charts": seen.charts}))
