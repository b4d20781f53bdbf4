"""A real browser for the page's tests: Debian's `chromium`, headless, driven over the Chrome
DevTools Protocol (a WebSocket, aiohttp's client), in asyncio (from trio: `in_asyncio`).

It records what a user's console would show as an error (console.error, an uncaught
exception, a resource that failed to load, a Content-Security-Policy refusal) and saves
screenshots as PNG files. `--host-resolver-rules` makes names resolve to 127.0.0.1, so that a
test can visit the server under a foreign name, as a DNS-rebinding page would.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


class Page:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future[Any]] = {}
        self.loaded = asyncio.Event()
        self.errors: list[str] = []

    async def read(self) -> None:
        async for message in self.ws:
            data = json.loads(message.data)
            if "id" in data:
                future = self.waiting.pop(data["id"])
                if "error" in data:
                    future.set_exception(RuntimeError(str(data["error"])))
                else:
                    future.set_result(data.get("result", {}))
            else:
                self.event(data["method"], data.get("params", {}))

    def event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Page.loadEventFired":
            self.loaded.set()
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append(" ".join(str(a.get("value", a)) for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            self.errors.append(str(params["exceptionDetails"]))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.errors.append(params["entry"].get("text", ""))

    async def send(self, method: str, **params: Any) -> Any:
        number = next(self.ids)
        future = asyncio.get_running_loop().create_future()
        self.waiting[number] = future
        await self.ws.send_str(json.dumps({"id": number, "method": method, "params": params}))
        return await asyncio.wait_for(future, 30)

    async def goto(self, url: str) -> None:
        self.loaded.clear()
        await self.send("Page.navigate", url=url)
        await asyncio.wait_for(self.loaded.wait(), 30)

    async def js(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise awaited)."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(str(result["exceptionDetails"]))
        return result["result"].get("value")

    async def text(self, element_id: str) -> str:
        return str(await self.js(f"document.getElementById({json.dumps(element_id)}).textContent"))

    async def until(self, expression: str, seconds: float = 20) -> Any:
        """Poll a JavaScript expression until it is truthy: its value."""
        async with asyncio.timeout(seconds):
            while not (value := await self.js(expression)):  # noqa: ASYNC110 (the page's state)
                await asyncio.sleep(0.05)
        return value

    async def screenshot(self, path: Path) -> None:
        shot = await self.send("Page.captureScreenshot", format="png")
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))


def launch(profile: Path, resolve: tuple[str, ...]) -> tuple[subprocess.Popen[bytes], str]:
    """A headless chromium with a fresh profile, and the port of its DevTools endpoint."""
    rules = ",".join(f"MAP {name} 127.0.0.1" for name in resolve)
    process = subprocess.Popen(
        [
            CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1200,900",
            *([f"--host-resolver-rules={rules}"] if rules else []), "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    port_file = profile / "DevToolsActivePort"  # written once the endpoint listens
    deadline = time.monotonic() + 30
    while not (port_file.is_file() and port_file.read_text().strip()):
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise RuntimeError(f"{CHROMIUM} did not start its DevTools endpoint")
        time.sleep(0.05)
    return process, port_file.read_text().split()[0]


@contextlib.asynccontextmanager
async def browser(profile: Path, resolve: tuple[str, ...] = ()) -> AsyncIterator[Page]:
    """A headless chromium's first tab, its page, runtime and log events enabled."""
    process, port = await asyncio.to_thread(launch, profile, resolve)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as answer:
                targets = await answer.json()
            url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
            async with session.ws_connect(url, max_msg_size=0) as ws:
                page = Page(ws)
                reader = asyncio.ensure_future(page.read())
                for domain in ("Page", "Runtime", "Log"):
                    await page.send(f"{domain}.enable")
                try:
                    yield page
                finally:
                    reader.cancel()
    finally:
        process.kill()
        process.wait()
