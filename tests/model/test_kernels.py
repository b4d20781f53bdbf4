"""Loom's CPU kernels against the torch operations they replace: decode attention read in place
(every head size, grouped queries, a last block part-filled, padding block 0, both ways of
splitting the work), the fused residual add + RMSNorm, rotary + the K/V write, SiLU * up; and
the library built once, then loaded with no compiler."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from loom.model import kernels
from loom.model.decoder_layer import rms_norm

pytestmark = pytest.mark.skipif(
    kernels.unavailable() is not None, reason=f"Loom's CPU kernels: {kernels.unavailable()}"
)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    kernels.load()


def sdpa_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor:
    """The reference: each sequence's keys gathered through its table, SDPA per KV head."""
    num_kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    out = []
    for s in range(q.shape[0]):
        keys = k_cache[tables[s]].reshape(-1, num_kv_heads, dim)[: lens[s]].transpose(0, 1)
        values = v_cache[tables[s]].reshape(-1, num_kv_heads, dim)[: lens[s]].transpose(0, 1)
        queries = q[s].view(num_kv_heads, -1, dim)
        o = F.scaled_dot_product_attention(queries, keys, values, scale=dim**-0.5)
        out.append(o.reshape(-1, dim))
    return torch.stack(out)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("num_seqs", [1, 3, 24])  # 24 x 2 KV heads: a task per KV head
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
def test_kernels_decode_attention_reads_the_pool_as_sdpa_does(
    head_dim: int, num_seqs: int, pool_dtype: torch.dtype
) -> None:
    """A float16 pool is read as its values are (SDPA over the same pool made float32)."""
    torch.manual_seed(head_dim + num_seqs)
    num_blocks, block_size, num_kv_heads, group = 40, 16, 2, 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(pool_dtype)
    v_cache = torch.randn_like(k_cache)
    lens = torch.randint(1, 4 * block_size, (num_seqs,))
    lens[0] = 3 * block_size + 5  # the last block part-filled
    tables = torch.zeros(num_seqs, 4, dtype=torch.long)  # padding: block 0
    for s in range(num_seqs):
        used = -(-int(lens[s]) // block_size)
        tables[s, :used] = torch.randperm(num_blocks - 1)[:used] + 1
    q = torch.randn(num_seqs, num_kv_heads * group, head_dim)
    out = torch.ops.loom.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    expected = sdpa_decode(q, k_cache.float(), v_cache.float(), tables, lens)
    assert torch.allclose(out, expected, atol=1e-5)


def windowed_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """The reference: each sequence's last `window` keys, scores soft-capped, as transformers'
    eager attention computes them."""
    num_kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    out = []
    for s in range(q.shape[0]):
        first, end = max(0, int(lens[s]) - window), int(lens[s])
        keys = k_cache[tables[s]].reshape(-1, num_kv_heads, dim)[first:end].transpose(0, 1)
        values = v_cache[tables[s]].reshape(-1, num_kv_heads, dim)[first:end].transpose(0, 1)
        scores = q[s].view(num_kv_heads, -1, dim) @ keys.transpose(1, 2) * dim**-0.5
        scores = torch.tanh(scores / softcap) * softcap if softcap else scores
        out.append((torch.softmax(scores, dim=-1) @ values).reshape(-1, dim))
    return torch.stack(out)


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize(("window", "softcap"), [(7, 0.0), (20, 0.0), (16, 0.5), (0, 0.5)])
def test_kernels_decode_attention_reads_only_the_window_and_soft_caps(
    head_dim: int, window: int, softcap: float
) -> None:
    """Keys before the window are never read: their blocks are the null block, filled with NaN
    (a slid-out block's entry), and the output stays finite and equal to the reference."""
    torch.manual_seed(head_dim + window)
    num_blocks, block_size, num_kv_heads, num_seqs = 40, 16, 2, 5
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor([1, 7, 17, 40, 63])
    tables = torch.zeros(num_seqs, 4, dtype=torch.long)
    for s in range(num_seqs):
        used = -(-int(lens[s]) // block_size)
        tables[s, :used] = torch.randperm(num_blocks - 1)[:used] + 1
    q = torch.randn(num_seqs, num_kv_heads * 3, head_dim)
    expected = windowed_decode(q, k_cache, v_cache, tables, lens, window or 1 << 20, softcap)
    if window:  # slide out: the blocks wholly before each window become the null block
        for s in range(num_seqs):
            tables[s, : max(0, int(lens[s]) - window) // block_size] = 0
    k_cache[0], v_cache[0] = float("nan"), float("nan")
    out = torch.ops.loom.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, head_dim**-0.5, window, softcap
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_kernels_decode_attention_refuses_a_negative_window_or_cap() -> None:
    k_cache = torch.randn(4, 16, 1, 16)
    args = (torch.randn(1, 1, 16), k_cache, k_cache, torch.tensor([[1]]), torch.tensor([3]), 0.25)
    for window, softcap in ((-1, 0.0), (0, -1.0)):
        with pytest.raises(RuntimeError, match="window and softcap must not be negative"):
            torch.ops.loom.paged_decode_attention(*args, window, softcap)


def test_kernels_decode_attention_refuses_a_table_entry_out_of_range() -> None:
    k_cache = torch.randn(4, 16, 1, 16)
    tables = torch.tensor([[5]])
    with pytest.raises(RuntimeError, match="block table entry out of range"):
        torch.ops.loom.paged_decode_attention(
            torch.randn(1, 1, 16), k_cache, k_cache, tables, torch.tensor([3]), 0.25
        )


def test_kernels_add_rms_norm_adds_in_place_and_normalises() -> None:
    torch.manual_seed(0)
    x, delta, weight = torch.randn(5, 64), torch.randn(5, 64), torch.rand(64)
    expected_sum = x + delta
    out = torch.ops.loom.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(x, expected_sum)  # the residual stream, updated in place
    assert torch.allclose(out, rms_norm(expected_sum, weight, 1e-5), rtol=1e-5, atol=1e-6)
    alone = torch.ops.loom.add_rms_norm(x, None, weight, 1e-5)
    assert torch.equal(x, expected_sum)
    assert torch.allclose(alone, rms_norm(x, weight, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
def test_kernels_rotary_write_kv_is_the_torch_arithmetic_bit_for_bit(
    pool_dtype: torch.dtype,
) -> None:
    """Into a float16 pool, k and v rounded as torch rounds them (`.half()`)."""
    torch.manual_seed(0)
    tokens, heads, kv_heads, dim = 5, 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    cos, sin = torch.randn(tokens, 1, dim), torch.randn(tokens, 1, dim)
    k_cache = torch.zeros(3, 4, kv_heads, dim, dtype=pool_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([9, 0, 4, 11, 5])
    q = torch.ops.loom.rotary_write_kv(qkv, cos, sin, slots, k_cache, v_cache, heads)
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, -1, dim)
    qk = qk * cos + qk.roll(dim // 2, dims=-1) * sin
    assert torch.equal(q, qk[:, :heads])
    assert torch.equal(k_cache.view(-1, kv_heads, dim)[slots], qk[:, heads:].to(pool_dtype))
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    assert torch.equal(v_cache.view(-1, kv_heads, dim)[slots], v.to(pool_dtype))
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.loom.rotary_write_kv(qkv, cos, sin, slots + 3, k_cache, v_cache, heads)


def test_kernels_silu_mul_is_silu_times_up_to_rounding() -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(7, 2 * 96) * 6
    gate_up[0, :8] = torch.tensor([-200.0, -90, -50, -1e-8, 0, 1e-8, 90, 200])
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.ops.loom.silu_mul(gate_up)
    assert torch.allclose(out, F.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_kernels_built_once_load_with_no_compiler_or_ninja() -> None:
    """A built library (this session's) is loaded as it is: a process with no compiler and
    nothing on PATH runs the kernels, as an image's runtime without g++ does."""
    assert kernels.built(kernels.library_path(kernels.isa()))
    code = (
        "import torch; from loom.model import kernels; kernels.load(); "
        "print(float(torch.ops.loom.silu_mul(torch.ones(1, 16)).sum()))"
    )
    env = {**os.environ, "CXX": "/nonexistent/c++", "PATH": "/nonexistent"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    # SiLU(1) * 1 for each of the 8 outputs (the 16 inputs are gate, then up)
    assert float(done.stdout) == pytest.approx(8 / (1 + float(torch.exp(torch.tensor(-1.0)))))


def test_kernels_not_built_and_no_compiler_say_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert not kernels.built(kernels.library_path(kernels.isa()))
    assert kernels.unavailable() == "building them needs /nonexistent/c++ on PATH"


@pytest.mark.parametrize("changed", ["step.cpp", "vec.h"])
def test_kernels_a_changed_source_is_built_anew_not_loaded_stale(
    changed: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library's folder is named by what it is built from: a source or header changed by a
    byte names another folder, beside the first."""
    before = kernels.library_path("avx2")
    for name in ("SOURCES", "HEADERS"):
        paths = list(getattr(kernels, name))
        for i, path in enumerate(paths):
            if path.name == changed:
                copy = tmp_path / changed
                copy.write_bytes(path.read_bytes() + b"\n")
                paths[i] = copy
        monkeypatch.setattr(kernels, name, paths)
    after = kernels.library_path("avx2")
    assert after != before
    assert after.parent.parent == before.parent.parent


@pytest.mark.parametrize("compiler", [None, "/nonexistent/c++"])
def test_kernels_vnni_s_library_missing_falls_back_to_a_built_avx2_one_only_with_no_compiler(
    compiler: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU with VNNI whose library is not built: with a compiler it is built (the faster
    products); with none, the AVX2 library baked beside it is loaded instead of none."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    if compiler is not None:
        monkeypatch.setenv("CXX", compiler)
    monkeypatch.setattr(kernels, "isa", lambda: "vnni")
    avx2 = kernels.library_path("avx2")
    avx2.parent.mkdir(parents=True)
    avx2.write_bytes(b"")  # built, as far as choosing goes (never loaded here)
    assert not kernels.built(kernels.library_path("vnni"))
    if compiler is None:
        assert kernels.unbuildable() is None  # this machine builds (g++ and ninja)
        assert kernels.choice() == "vnni"
    else:
        assert kernels.choice() == "avx2"
        assert kernels.unavailable() is None
