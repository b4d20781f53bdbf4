"""The Triton paged decode kernel (loom/model/triton_decode.py) against Loom's gather + SDPA
path and its CPU kernel: random block tables, grouped queries, lengths across block edges,
sliding windows, soft caps, split keys, padded rows. On CPU the kernels run under Triton's
interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets before torch, or triton, is
imported; it has no bfloat16 arithmetic, so the pools are float32 and float16); with
LOOM_TEST_DEVICE=cuda, compiled. Each feature's test also shows the reference changes without
the feature, so that the kernel's agreement is not agreement by default."""

from __future__ import annotations

import os

import pytest
import torch

from loom.model import kernels
from loom.model.attention import paged_attention
from loom.model.attention_metadata import build_attention_metadata
from tests.support.placement import DEVICE, ON_GPU

pytest.importorskip("triton")
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it
    pytest.fail("the Triton kernels need TRITON_INTERPRET=1 on the CPU")

from loom.model.triton_decode import num_splits_for, paged_decode_attention

BLOCK_SIZE = 16
NUM_BLOCKS = 48


def pool(num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    return torch.randn(shape, generator=generator).to(DEVICE, dtype)


def random_tables(lens: list[int], seed: int) -> list[list[int]]:
    """Each row's blocks, distinct and shuffled, never the null block 0."""
    generator = torch.Generator().manual_seed(seed)
    tables = []
    for length in lens:
        used = -(-length // BLOCK_SIZE)
        tables.append((torch.randperm(NUM_BLOCKS - 1, generator=generator)[:used] + 1).tolist())
    return tables


def padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)


def gathered(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: list[int],
    tables: list[list[int]],
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The reference: Loom's gather + SDPA (or eager soft-capped) attention for the same rows,
    in float32 (a float16 pool read as its values)."""
    num_kv_heads = k_cache.shape[2]
    metadata = build_attention_metadata(
        num_computed=[n - 1 for n in lens],
        query_lens=[1] * len(lens),
        block_tables=tables,
        block_size=BLOCK_SIZE,
        device=DEVICE,
        num_queries_per_kv=q.shape[1] // num_kv_heads,
        windows=[window] if window else [],
    )
    scale = q.shape[-1] ** -0.5
    return paged_attention(
        q.float(), k_cache.float(), v_cache.float(), metadata, scale, window, softcap
    )


def triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens: list[int],
    tables: list[list[int]],
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int = 1,
) -> torch.Tensor:
    seq_lens = torch.tensor(lens, device=DEVICE)
    scale = q.shape[-1] ** -0.5
    out = paged_decode_attention(
        q, k_cache, v_cache, padded(tables), seq_lens, scale, window, softcap, num_splits
    )
    assert out.dtype == q.dtype
    assert out.shape == q.shape
    return out.float()


TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("head_dim", [64, 80, 128])  # 80: padded to 128 lanes
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_decode_reads_the_pool_as_gather_and_sdpa_do(
    head_dim: int, group: int, dtype: torch.dtype
) -> None:
    """Lengths 1, one block, one past it, a last block part-filled, ten blocks; a float16 pool
    under float32 queries (a CPU model's) and under float16 queries (a GPU model's)."""
    lens = [1, 16, 17, 43, 160]
    tables = random_tables(lens, seed=head_dim + group)
    k_cache, v_cache = (pool(2, head_dim, dtype, seed) for seed in (1, 2))
    for q_dtype in {torch.float32, dtype}:
        q = torch.randn(len(lens), 2 * group, head_dim).to(DEVICE, q_dtype)
        out = triton(q, k_cache, v_cache, lens, tables)
        expected = gathered(q, k_cache, v_cache, lens, tables)
        torch.testing.assert_close(out, expected, rtol=0, atol=TOLERANCE[q_dtype])


def test_triton_decode_follows_the_block_table() -> None:
    """The same keys through another table give another answer, and the kernel follows it."""
    lens = [40, 70]
    tables = random_tables(lens, seed=3)
    shuffled = [t[::-1] for t in tables]
    k_cache, v_cache = (pool(2, 64, torch.float32, seed) for seed in (4, 5))
    q = torch.randn(2, 4, 64, device=DEVICE)
    expected = gathered(q, k_cache, v_cache, lens, shuffled)
    assert not torch.allclose(gathered(q, k_cache, v_cache, lens, tables), expected, atol=1e-3)
    torch.testing.assert_close(triton(q, k_cache, v_cache, lens, shuffled), expected)


@pytest.mark.parametrize(("window", "softcap"), [(7, None), (20, None), (16, 0.5), (None, 0.5)])
def test_triton_decode_reads_only_the_window_and_soft_caps(
    window: int | None, softcap: float | None
) -> None:
    """The blocks wholly before a window are the null block, filled with NaN (a slid-out
    block's entry): never read, the output finite and the reference's."""
    lens = [1, 7, 17, 40, 63]
    tables = random_tables(lens, seed=6)
    k_cache, v_cache = (pool(2, 64, torch.float32, seed) for seed in (7, 8))
    q = 4 * torch.randn(len(lens), 6, 64, device=DEVICE)  # large scores: the cap matters
    expected = gathered(q, k_cache, v_cache, lens, tables, window, softcap)
    plain = gathered(q, k_cache, v_cache, lens, tables)
    assert not torch.allclose(plain, expected, atol=1e-3)  # the feature changes the answer
    if window:
        for table, length in zip(tables, lens, strict=True):
            table[: max(0, length - window) // BLOCK_SIZE] = [0] * (
                max(0, length - window) // BLOCK_SIZE
            )
        k_cache[0], v_cache[0] = float("nan"), float("nan")
    out = triton(q, k_cache, v_cache, lens, tables, window, softcap)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_triton_decode_split_keys_combine_to_the_whole_softmax(num_splits: int) -> None:
    """Splits of a row's keys (more splits than a short row has tiles: some splits empty),
    with a window that starts mid-block."""
    lens = [5, 100, 300]
    tables = random_tables(lens, seed=num_splits)
    k_cache, v_cache = (pool(2, 64, torch.float32, seed) for seed in (9, 10))
    q = torch.randn(len(lens), 6, 64, device=DEVICE)
    for window in (None, 90):
        expected = gathered(q, k_cache, v_cache, lens, tables, window)
        out = triton(q, k_cache, v_cache, lens, tables, window, num_splits=num_splits)
        torch.testing.assert_close(out, expected, rtol=0, atol=2e-5)


def test_triton_decode_a_padded_row_of_no_keys_writes_zeros() -> None:
    """A fixed-size step's padding rows (length 0, table of block 0) read nothing and give 0,
    split or not; the real rows beside them are untouched."""
    lens = [0, 33, 0]
    tables = [[0], random_tables([33], seed=11)[0], [0]]
    k_cache, v_cache = (pool(2, 64, torch.float32, seed) for seed in (12, 13))
    k_cache[0], v_cache[0] = float("nan"), float("nan")
    q = torch.randn(3, 4, 64, device=DEVICE)
    for num_splits in (1, 4):
        out = triton(q, k_cache, v_cache, lens, tables, num_splits=num_splits)
        assert out[0].eq(0).all()
        assert out[2].eq(0).all()
        expected = gathered(q[1:2], k_cache, v_cache, [33], tables[1:2])
        torch.testing.assert_close(out[1:2], expected, rtol=0, atol=2e-5)


def test_triton_decode_reads_queries_with_the_qkv_projection_s_strides() -> None:
    """The queries as the decoder hands them: a view of the fused q/k/v rows, not contiguous."""
    lens = [20, 50]
    tables = random_tables(lens, seed=14)
    k_cache, v_cache = (pool(2, 64, torch.float32, seed) for seed in (15, 16))
    qkv = torch.randn(2, 4 + 2 + 2, 64, device=DEVICE)
    q = qkv[:, :4]
    assert not q.is_contiguous()
    expected = gathered(q.contiguous(), k_cache, v_cache, lens, tables)
    torch.testing.assert_close(triton(q, k_cache, v_cache, lens, tables), expected)


@pytest.mark.skipif(
    ON_GPU or kernels.unavailable() is not None, reason="Loom's CPU kernel runs on the CPU"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_decode_equals_loom_s_cpu_kernel(dtype: torch.dtype) -> None:
    kernels.load()
    lens = [3, 16, 31, 77, 129]
    tables = random_tables(lens, seed=17)
    k_cache, v_cache = (pool(2, 64, dtype, seed) for seed in (18, 19))
    q = torch.randn(len(lens), 6, 64)
    for window, softcap in ((0, 0.0), (24, 0.0), (0, 0.7)):
        cpu = torch.ops.loom.paged_decode_attention(
            q, k_cache, v_cache, padded(tables), torch.tensor(lens), 64**-0.5, window, softcap
        )
        out = triton(q, k_cache, v_cache, lens, tables, window or None, softcap or None)
        torch.testing.assert_close(out, cpu, rtol=0, atol=2e-5)


def test_triton_decode_splits_only_where_rows_leave_the_gpu_idle() -> None:
    assert num_splits_for(1, 8, 4096, num_sms=132) == 16  # batch 1, long: split (capped)
    assert num_splits_for(1, 8, 192, num_sms=132) == 1  # short: one program reads it faster
    assert num_splits_for(64, 8, 4096, num_sms=132) == 1  # 512 programs fill 132 SMs
    assert num_splits_for(4, 2, 1024, num_sms=132) == 8  # 8 programs: 1024 keys in 8 ranges
