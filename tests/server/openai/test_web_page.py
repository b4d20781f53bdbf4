"""The page at `/` in a real browser (Debian's headless chromium, tests/support/browser.py)
against a real server: it loads with no console error, its figures move while `loom bench`
runs against the server, its playground streams a chat answer (the one the API gives at
temperature 0) and one that a JSON schema constrains, and with keys set it does nothing until
the key is typed. Raw HTTP and a browser visiting under a foreign name: the page is not served
to a foreign `Host` or origin, nor at all with `--no-web-ui`. Screenshots are kept in each
test's temporary folder (CI's artifacts).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

from loom.model.loader import LoadedModel
from loom.server.openai.config import HttpConfig
from loom.server.tenants import TenantConfig
from tests.support.browser import Page, browser
from tests.support.faults import calling_before_each_step
from tests.support.grpc_client import in_asyncio
from tests.support.http_client import openai_client, post
from tests.support.server_harness import serving

HTTP = HttpConfig(http_port=0)
ASKED = "Name three colours."
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}}
SCHEMA |= {"required": ["colour"], "additionalProperties": False}
FIGURE = "Number(document.getElementById({!r}).textContent.replace(/,/g, ''))"


def bench(grpc_port: int, http_port: int) -> subprocess.Popen[bytes]:
    """`loom bench` against the running server, through its HTTP API."""
    return subprocess.Popen(
        [
            sys.executable, "-m", "loom", "bench", "--address", f"127.0.0.1:{grpc_port}",
            "--api", "openai", "--http-address", f"127.0.0.1:{http_port}",
            "--num-prompts", "24", "--concurrency", "4", "--input-len", "32",
            "--output-len", "96", "--warmup", "0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip


async def test_the_dashboard_loads_cleanly_and_moves_while_a_benchmark_runs(
    tiny_chat: LoadedModel, tmp_path: Path
) -> None:
    slow = calling_before_each_step(lambda _: time.sleep(0.005))
    async with serving(tiny_chat, slow, http=HTTP) as (server, port):
        http_port = server.http_port or 0

        async def watch() -> dict[str, Any]:
            async with browser(tmp_path / "profile") as page:
                await page.goto(f"http://127.0.0.1:{http_port}/")
                await page.until(f"{FIGURE.format('running')} >= 0")
                idle = await page.text("generated")
                await page.screenshot(tmp_path / "dashboard-idle.png")
                load = bench(port, http_port)
                try:
                    running = await page.until(f"{FIGURE.format('running')} > 0", 60)
                    rate = await page.until(f"{FIGURE.format('throughput')} > 0", 60)
                    await page.screenshot(tmp_path / "dashboard-load.png")
                    _, stderr = await asyncio.to_thread(load.communicate, None, 120)
                finally:
                    load.kill()
                generated = await page.until(f"{FIGURE.format('generated')} >= 24 * 96", 30)
                line = await page.js("document.getElementById('line').getAttribute('points')")
                tenants = await page.js("document.querySelector('#tenants tbody').innerText")
                return {
                    "idle": idle, "running": running, "rate": rate, "generated": generated,
                    "line": line, "tenants": tenants, "errors": page.errors,
                    "bench": load.returncode, "stderr": stderr,
                }  # fmt: skip

        with trio.fail_after(240):
            seen = await in_asyncio(watch)
    assert seen["bench"] == 0, seen["stderr"]
    assert seen["idle"] == "0"
    assert seen["running"]
    assert seen["rate"]
    assert seen["generated"]
    assert len(seen["line"].split()) > 2
    assert seen["tenants"].startswith("127.0.0.1")
    assert seen["errors"] == []
    assert (tmp_path / "dashboard-load.png").stat().st_size > 10_000


async def chat(page: Page, text: str, schema: dict[str, Any] | None = None) -> list[str]:
    """Send `text` from the playground at temperature 0; the answer's text as the page
    showed it, every 10 ms until it is whole."""
    await page.js("document.getElementById('tab-playground').click()")
    fields = {"prompt": text, "temperature": "0", "max-tokens": "40"}
    fields["schema"] = json.dumps(schema) if schema else ""
    for field, value in fields.items():
        await page.js(f"document.getElementById({field!r}).value = {json.dumps(value)}")
    before = await page.js("document.querySelectorAll('.turn.assistant').length")
    await page.js("document.getElementById('send').click()")
    await page.until(f"document.querySelectorAll('.turn.assistant').length > {before}")
    shown = []
    last = "Array.from(document.querySelectorAll('.turn.assistant')).pop().textContent"
    while True:
        shown.append(await page.js(last))
        if await page.js("!document.getElementById('send').disabled"):
            shown.append(await page.js(last))
            return shown
        await asyncio.sleep(0.01)


async def test_the_playground_streams_the_answer_the_api_gives(
    tiny_chat: LoadedModel, tmp_path: Path
) -> None:
    slow = calling_before_each_step(lambda _: time.sleep(0.03))  # 30 ms a token
    async with serving(tiny_chat, slow, http=HTTP) as (server, _):
        http_port = server.http_port or 0

        async def talk() -> tuple[list[str], list[str], list[str]]:
            async with browser(tmp_path / "profile") as page:
                await page.goto(f"http://127.0.0.1:{http_port}/")
                await page.until("document.getElementById('model').textContent")
                plain = await chat(page, ASKED)
                await page.js("document.getElementById('clear').click()")
                constrained = await chat(page, ASKED, SCHEMA)
                await page.screenshot(tmp_path / "playground.png")
                return plain, constrained, page.errors

        with trio.fail_after(120):
            plain, constrained, errors = await in_asyncio(talk)
            client = openai_client(http_port)
            answer = await trio.to_thread.run_sync(
                lambda: client.chat.completions.create(
                    model="tiny-llama",
                    messages=[{"role": "user", "content": ASKED}],
                    temperature=0,
                    max_tokens=40,
                )
            )
    assert errors == []
    assert plain[-1] == answer.choices[0].message.content
    partial = {s for s in plain if s and s != plain[-1]}
    assert len(partial) >= 3, plain  # it came in pieces, as they were made
    assert json.loads(constrained[-1])["colour"] in ("red", "green")


async def test_with_keys_the_page_works_only_once_the_key_is_typed(
    tiny_chat: LoadedModel, tmp_path: Path, key_file: str
) -> None:
    tenants = TenantConfig(api_key_file=key_file)
    async with serving(tiny_chat, tenants=tenants, http=HTTP) as (server, _):
        http_port = server.http_port or 0

        async def visit() -> dict[str, Any]:
            async with browser(tmp_path / "profile") as page:
                await page.goto(f"http://127.0.0.1:{http_port}/")
                refused = await page.until("document.getElementById('notice').textContent")
                await asyncio.sleep(1.5)  # a poll or two more: still nothing shown
                locked = await page.text("running")
                refused_chat = (await chat(page, ASKED))[-1]
                await page.screenshot(tmp_path / "locked.png")
                await page.js("document.getElementById('key').value = 'key-of-b'")
                await page.js("document.getElementById('key-form').requestSubmit()")
                await page.js("document.getElementById('tab-dashboard').click()")
                await page.until(f"{FIGURE.format('running')} >= 0")
                answered = (await chat(page, ASKED))[-1]
                await page.js("document.getElementById('tab-dashboard').click()")
                await page.until("document.querySelector('#tenants tbody').innerText")
                await page.screenshot(tmp_path / "unlocked.png")
                return {
                    "refused": refused, "locked": locked, "refused_chat": refused_chat,
                    "answered": answered, "viewer": await page.text("viewer"),
                    "tenants": await page.js("document.querySelector('#tenants tbody').innerText"),
                    "kept": await page.js("sessionStorage.getItem('loom-api-key')"),
                    "stored": await page.js("localStorage.length"),
                }  # fmt: skip

        with trio.fail_after(120):
            seen = await in_asyncio(visit)
    assert "API key" in seen["refused"]
    assert seen["locked"] == "-"
    assert seen["refused_chat"] == "an API key is needed"
    assert seen["answered"]
    assert seen["answered"] != "an API key is needed"
    assert seen["viewer"] == "your tenant's"
    assert seen["tenants"].split("\t")[0] == "b"  # its own row alone
    assert (seen["kept"], seen["stored"]) == ("key-of-b", 0)


async def test_the_page_is_not_served_to_a_foreign_host_or_origin(
    tiny_chat: LoadedModel, tmp_path: Path
) -> None:
    allowed = HttpConfig(http_port=0, allowed_origins=("https://app.example",))
    async with serving(tiny_chat, http=allowed) as (server, _):
        port = server.http_port or 0
        answers = {
            name: (await post(port, "/", None, headers, method="GET"))[0]
            for name, headers in {
                "own": {"Origin": f"http://127.0.0.1:{port}"},
                "allowed origin": {"Origin": "https://app.example"},
                "foreign origin": {"Origin": "http://evil.example"},
                "foreign host": {"Host": "evil.example"},
            }.items()
        }

        async def rebound() -> Any:
            async with browser(tmp_path / "profile", resolve=("evil.example",)) as page:
                await page.goto(f"http://evil.example:{port}/")
                return await page.js("document.getElementById('dashboard') === null")

        with trio.fail_after(60):
            not_shown = await in_asyncio(rebound)
    assert answers == {
        "own": 200,
        "allowed origin": 200,
        "foreign origin": 403,
        "foreign host": 400,
    }
    assert not_shown
    async with serving(tiny_chat, http=HttpConfig(http_port=0, web_ui=False)) as (server, _):
        port = server.http_port or 0
        for path in ("/", "/ui/app.js", "/ui/style.css"):
            assert (await post(port, path, None, method="GET"))[0] == 404
        assert (await post(port, "/stats", None, method="GET"))[0] == 200
