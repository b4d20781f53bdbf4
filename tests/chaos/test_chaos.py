"""`loom chaos` as a user runs it: a process of its own against a launched server process.

Against a healthy server with the simulated model every scenario passes (exit 0), with the
server's stall timeout short enough that the stopped readers are ended by it. Against a server
that leaks a KV block for each aborted request (tests/chaos/leaky_server.py) it exits 1 and
names the blocks held: the tool can fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import trustme

from loom.bench.serving import launched_process
from loom.chaos.command import HOSTILE, SCENARIOS

SIM = "--model sim:step_ms=1"
# The stopped readers: streams far longer than the buffers between the engine and a reader
# (the engine's, the server's, the kernel's, the reader's; over HTTP the server's made small),
# and a stop long enough for the engine to fill them and pause, then for the 0.5 s stall timer
# to end it, with steps 10-20 times slower than 1 ms. (600 tokens, the server's 64 KiB and a
# 3 s stop were too few on one CI machine: every reader was sent its whole stream, as here
# with steps of 8 ms.)
STALLS = "--stall-timeout 0.5"
STOPS = ("--stop-for", "6", "--stop-tokens", "2000")
CHAOS = [sys.executable, "-m", "loom", "chaos", "--clients", "40", "--json"]


def chaos(*args: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    result = subprocess.run(
        [*CHAOS, *args], capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode in (0, 1), result.stderr[-3000:]
    return result.returncode, json.loads(result.stdout)


def passed(code: int, report: dict, names: list[str]) -> dict:  # type: ignore[type-arg]
    """The report's scenarios by name, after checking that these ran and all passed, and what
    the kill, cancel and stopped-reader scenarios saw (40 clients, stall timeout 0.5 s)."""
    by_name = {s["name"]: s for s in report["scenarios"]}
    assert list(by_name) == names
    problems = {name: s["problems"] for name, s in by_name.items() if s["problems"]}
    assert not problems, json.dumps(problems)
    assert (code, report["ok"]) == (0, True)
    assert by_name["kill"]["outcomes"] == {"killed": 2}
    cancelled = by_name["cancel"]["outcomes"]  # "ok": a stream sent whole before its cancel
    assert set(cancelled) <= {"cancelled", "ok"}
    assert cancelled.get("cancelled", 0) >= 30
    stopped = by_name["stopped-readers"]["outcomes"]
    assert sum(stopped.values()) == 10
    assert "ok" not in stopped  # all ended by the stall timer
    return by_name


def test_chaos_passes_a_healthy_server_in_every_scenario() -> None:
    serve = f"{SIM} {STALLS} --preface-timeout 1 --header-timeout 1"
    code, report = chaos("--serve", serve, *STOPS, "--hold-wait", "5")
    by_name = passed(code, report, list(SCENARIOS))
    overload = by_name["overload"]["figures"]
    (fillers, burst, refused, admitted) = overload.values()
    assert (fillers, burst) == (64, 768)  # 3x the queue of 256
    assert 512 - admitted <= refused <= 512  # exactly 512 unless a filler paused
    outcomes = by_name["overload"]["outcomes"]
    assert outcomes == {"released": 64, "RESOURCE_EXHAUSTED": refused, "ok": 768 - refused}
    assert by_name["deadlines"]["outcomes"]["ok"] >= 5  # the ample ones at least
    assert by_name["drain"]["outcomes"] == {"ok": 10}
    assert by_name["rapid-reset"]["outcomes"] == {"pairs: GOAWAY ENHANCE_YOUR_CALM": 1}
    flood = by_name["control-flood"]["outcomes"]
    assert flood["ping: GOAWAY ENHANCE_YOUR_CALM"] == flood["settings: GOAWAY ENHANCE_YOUR_CALM"]
    assert by_name["slowloris"]["outcomes"] == {"closed by the server": 50}
    assert by_name["header-fragments"]["outcomes"] == {"closed by the server": 51}


def test_chaos_over_the_http_api_passes_every_scenario_that_applies() -> None:
    serve = f"{SIM} {STALLS} --write-buffer-bytes 4096"
    code, report = chaos("--api", "openai", "--serve", serve, *STOPS)
    by_name = passed(code, report, [name for name in SCENARIOS if name not in HOSTILE])
    (fillers, burst, refused, admitted) = by_name["overload"]["figures"].values()
    assert (fillers, burst) == (64, 768)
    assert 512 - admitted <= refused <= 512  # 429s, exactly the excess unless a filler paused
    assert by_name["deadlines"]["outcomes"]["DEADLINE_EXCEEDED"] >= 1  # 408s
    assert by_name["drain"]["outcomes"] == {"ok": 10}


def test_chaos_against_an_address_runs_every_scenario_but_drain() -> None:
    timeouts = ["--preface-timeout", "1", "--header-timeout", "1"]
    with launched_process([*SIM.split(), *timeouts]) as (port, _):
        code, report = chaos("--address", f"127.0.0.1:{port}", "--hold-wait", "5")
    assert [s["name"] for s in report["scenarios"]] == [n for n in SCENARIOS if n != "drain"]
    assert (code, report["ok"]) == (0, True), report


def test_chaos_fails_against_a_server_that_leaks_a_block_per_abort() -> None:
    with launched_process(SIM.split(), module="tests.chaos.leaky_server") as (port, _):
        scenarios = ["--scenarios", "cancel,slow-readers", "--settle-timeout", "3"]
        code, report = chaos("--address", f"127.0.0.1:{port}", *scenarios)
    assert code == 1
    assert not report["ok"]
    cancel, slow = report["scenarios"]
    assert cancel["outcomes"] == {"cancelled": 40}  # the clients saw nothing wrong
    (problem,) = cancel["problems"]
    assert problem.startswith("not idle 3 s after: "), problem
    assert problem.endswith(" blocks held"), problem
    assert "0 running, 0 waiting, 0 paused, 40 of " in problem  # one block per cancel
    assert slow["problems"] == [problem]  # the same 40 blocks: slow readers leak nothing


def test_chaos_over_tls_runs_every_scenario_of_grpc_clients(tmp_path: Path) -> None:
    """Against a TLS port: every scenario but the bare-HTTP/2 ones (and drain), which it says
    it cannot run over TLS when asked for."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    server = ca.issue_cert("127.0.0.1")
    server.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    server.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    tls = [
        "--tls-cert-file",
        str(tmp_path / "cert.pem"),
        "--tls-key-file",
        str(tmp_path / "key.pem"),
    ]
    with launched_process([*SIM.split(), *tls]) as (port, _):
        address = ["--address", f"127.0.0.1:{port}", "--tls-ca-file", str(tmp_path / "ca.pem")]
        code, report = chaos(*address)
        refused = subprocess.run(
            [*CHAOS, *address, "--scenarios", "rapid-reset"], capture_output=True, text=True
        )
    expected = [n for n in SCENARIOS if n not in HOSTILE and n != "drain"]
    assert [s["name"] for s in report["scenarios"]] == expected
    assert (code, report["ok"]) == (0, True), report
    assert refused.returncode == 1
    assert "rapid-reset speak bare HTTP/2 in plaintext" in refused.stderr
