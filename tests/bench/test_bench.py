"""`loom bench`: its figures on hand-made timings, and one real run against a launched server."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch

from loom.bench.baseline import baseline_placement
from loom.bench.metrics import Objectives, RequestTiming, percentile, summarize
from loom.bench.serving import TEXT, make_rewrite_workload, make_workload
from loom.cli import main


def test_bench_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert math.isclose(percentile(values, 90), 3.7)
    assert math.isnan(percentile([], 50))


def test_bench_summary_figures_follow_their_definitions() -> None:
    fast = RequestTiming(ok=True, num_prompt_tokens=4, token_times=(0.1, 0.2, 0.2, 0.5))
    slow = RequestTiming(ok=True, num_prompt_tokens=4, token_times=(1.0, 2.0))
    failed = RequestTiming(ok=False, num_prompt_tokens=4, token_times=(), error="boom")
    summary = summarize([fast, slow, failed], duration=2.0, objectives=Objectives(ttft_ms=500))
    assert (summary["completed"], summary["failed"], summary["output_tokens"]) == (2, 1, 6)
    assert summary["output_throughput"] == 3.0
    assert summary["request_throughput"] == 1.0
    assert summary["goodput"] == 0.5  # only the fast request met TTFT <= 500 ms
    ttft: Any = summary["ttft_ms"]
    assert math.isclose(ttft["mean"], 550.0)
    tpot: Any = summary["tpot_ms"]
    assert math.isclose(tpot["p50"], (400 / 3 + 1000) / 2)  # (e2e - ttft) / (n - 1)
    itl: Any = summary["itl_ms"]
    assert math.isclose(itl["p50"], 200.0)  # gaps 0, 100, 300, 1000
    assert summary["errors"] == ["boom"]


def test_bench_workload_prompts_have_the_exact_length_and_differ(smollm2_tokenizer: Any) -> None:
    workload = make_workload(smollm2_tokenizer, 8, 128, 16, seed=3)
    assert {len(p) for p in workload.prompts} == {128}
    assert len(set(workload.prompts)) == 8
    assert make_workload(smollm2_tokenizer, 8, 128, 16, seed=3) == workload


def test_bench_rewrite_prompts_ask_for_a_passage_of_the_shipped_text(
    smollm2_tokenizer: Any,
) -> None:
    workload = make_rewrite_workload(smollm2_tokenizer, 4, 64, 16, seed=3)
    text = " ".join(TEXT.read_text().split())
    for prompt in workload.prompts:
        chat = smollm2_tokenizer.decode(prompt)
        assert "word for word" in chat
        passage = chat.split("without any change:")[1].split("<|im_end|>")[0].strip()
        assert passage.replace("\n\n", " ") in text  # paragraphs unwrapped, in the text's order
        assert len(smollm2_tokenizer.encode(passage)) in range(60, 69)  # 64 as tokenized alone
    assert len(set(workload.prompts)) == 4
    assert make_rewrite_workload(smollm2_tokenizer, 4, 64, 16, seed=3) == workload


def test_bench_runs_against_a_launched_server_with_the_baseline(
    tiny_folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "loom", "bench", "--model", str(tiny_folder)]
    command += ["--concurrency", "1,3", "--num-prompts", "4", "--input-len", "16"]
    command += ["--output-len", "8", "--baseline", "--goodput", "ttft=60000", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "output tok/s" in result.stdout
    assert "ratio" in result.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["concurrency"] for r in runs] == [1, 3]
    for run in runs:
        for side in ("loom", "baseline"):
            assert run[side]["completed"] == 4
            assert run[side]["output_tokens"] == 32
            assert run[side]["goodput"] > 0
        assert run["loom"]["server"]["num_total_blocks"] > 0


def test_bench_baseline_runs_on_the_launched_server_s_device_and_dtype() -> None:
    """transformers runs where `--serve-args` puts the server, in its dtype (auto as `loom
    serve`'s: here the CPU in float32), so that the ratio compares one device with itself."""

    def placement(serve_args: str, baseline: bool = True) -> tuple[torch.device, torch.dtype]:
        return baseline_placement(baseline, serve_args)

    auto = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert placement("--max-num-seqs 8")[0] == auto
    assert placement("--device cpu --dtype bf16") == (torch.device("cpu"), torch.bfloat16)
    assert placement("--max-num-seqs 8 --device=cpu") == (torch.device("cpu"), torch.float32)
    assert placement("--dtype bf16", baseline=False) == (torch.device("cpu"), torch.float32)


def test_bench_drives_the_simulated_model_with_many_streams(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "loom", "bench", "--model", "sim:step_ms=1"]
    command += ["--concurrency", "300", "--input-len", "8", "--output-len", "8"]
    # 300 at once: over the default waiting-queue limit (256) while the first are admitted.
    command += ["--serve-args=--max-num-seqs 512 --max-waiting-requests 1024"]
    command += ["--json", str(out), "--plot", str(tmp_path / "bench.svg")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    svg = ET.parse(tmp_path / "bench.svg").getroot()
    assert len(list(svg.iter("{http://www.w3.org/2000/svg}polyline"))) == 3  # Loom, 3 panels
    (run,) = json.loads(out.read_text())["runs"]
    assert run["loom"]["completed"] == 300
    assert run["loom"]["output_tokens"] == 300 * 8


def test_bench_prints_the_acceptance_of_draft_tokens() -> None:
    """A simulated model whose output cycles, with n-gram drafts: every draft is accepted."""
    command = [sys.executable, "-m", "loom", "bench", "--model", "sim:step_ms=1,cycle=7"]
    command += ["--concurrency", "2", "--input-len", "8", "--output-len", "40"]
    command += ["--serve-args=--speculative-method ngram --num-speculative-tokens 4"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "drafts accepted 100.0%, mean accepted length 5.00" in result.stdout


@pytest.mark.parametrize("workload", ["standard", "multi-turn"])
def test_bench_drives_both_fronts_with_the_same_workload_and_their_cpu_per_token(
    workload: str, tiny_folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "loom", "bench", "--model", str(tiny_folder), "--api", "both"]
    command += ["--workload", workload, "--concurrency", "3", "--turns", "2"]
    command += ["--input-len", "8", "--output-len", "8", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "HTTP API" in result.stdout
    (run,) = json.loads(out.read_text())["runs"]
    grpc, http = run["loom"], run["openai"]
    assert (grpc["api"], http["api"]) == ("grpc", "openai")
    requests = 6 if workload == "multi-turn" else 3
    assert grpc["completed"] == http["completed"] == requests
    assert grpc["output_tokens"] == http["output_tokens"] == requests * 8  # each token counted
    assert grpc["cpu_ms_per_token"] > 0
    assert http["cpu_ms_per_token"] > 0


def test_bench_constrains_a_share_of_requests_each_still_of_the_output_length(
    tiny_folder: Path, tmp_path: Path
) -> None:
    """--constrained-fraction 0.5: half the requests carry the records schema, through both
    fronts; none ends early (the schema cannot end before --output-len), none fails."""
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "loom", "bench", "--model", str(tiny_folder), "--api", "both"]
    command += ["--concurrency", "4", "--input-len", "8", "--output-len", "12"]
    command += ["--constrained-fraction", "0.5", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "50% constrained by a JSON schema" in result.stdout
    (run,) = json.loads(out.read_text())["runs"]
    for front in (run["loom"], run["openai"]):
        assert front["completed"] == 4
        assert front["output_tokens"] == 4 * 12


@pytest.mark.parametrize("workload", ["shared-prefix", "multi-turn"])
def test_bench_prefix_workloads_compare_caching_on_and_off(
    workload: str, tiny_folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "loom", "bench", "--model", str(tiny_folder)]
    command += ["--workload", workload, "--concurrency", "3", "--prefix-len", "40"]
    command += ["--turns", "3", "--input-len", "8", "--output-len", "8"]
    command += ["--compare-prefix-caching", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "caching off" in result.stdout
    (run,) = json.loads(out.read_text())["runs"]
    requests = 9 if workload == "multi-turn" else 3
    on, off = run["loom"], run["caching_off"]
    assert on["completed"] == off["completed"] == requests
    assert on["server"]["prompt_tokens_cached"] > 0
    assert off["server"]["prompt_tokens_cached"] == 0
    # The same prompts: what one computed and found, the other computed.
    total = on["server"]["prompt_tokens_computed"] + on["server"]["prompt_tokens_cached"]
    assert total == off["server"]["prompt_tokens_computed"]


TWO_OF_ONE_NAME = ["--llama-gguf", "a/x.gguf", "--llama-gguf", "b/x.gguf"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--concurrency", "1,x"], "--concurrency takes whole numbers separated by commas"),
        (["--concurrency", "8,0"], "--concurrency must be at least 1, got 0"),
        (["--num-prompts", "0"], "--num-prompts must be at least 1, got 0"),
        (["--output-len", "0"], "--output-len must be at least 1, got 0"),
        (["--request-rate", "0"], "--request-rate must be above 0"),
        (["--goodput", "ttfb=100"], "--goodput takes ttft, tpot and e2e, not ttfb"),
        (["--turns", "0"], "--turns must be at least 1, got 0"),
        (
            ["--workload", "multi-turn", "--baseline"],
            "--baseline and --llama-server run the standard and rewrite workloads",
        ),
        (["--compare-prefix-caching"], "--compare-prefix-caching launches both servers"),
        (["--api", "openai"], "--api openai with --address needs --http-address HOST:PORT"),
        (["--llama-server", "/no/llama-server"], "--llama-server: no such file: /no/llama-server"),
        (
            ["--llama-server", sys.executable, "--model", "some/folder"],
            "--llama-server serves GGUF files; the model is some/folder",
        ),
        (["--llama-gguf", "a.gguf"], "--llama-gguf names what --llama-server serves"),
        (["--llama-args", "--spec-type ngram-simple"], "--llama-args are flags of --llama-server"),
        (
            ["--llama-server", sys.executable, *TWO_OF_ONE_NAME],
            "--llama-gguf: each file needs a name of its own",
        ),
        (
            ["--llama-server", sys.executable, "--llama-gguf", "/no/model.gguf"],
            "--llama-server: no such GGUF file: /no/model.gguf",
        ),
    ],
)
def test_bench_refuses_bad_flags_by_name(flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--address", "127.0.0.1:1", *flags])
    assert message in str(exit_info.value.code)


def test_bench_says_when_no_server_answers(tiny_folder: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "loom", "bench", "--model", str(tiny_folder)]
    command += ["--address", f"127.0.0.1:{port}", "--concurrency", "1", "--input-len", "8"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"no server answers at 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
