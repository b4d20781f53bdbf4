"""The exponential race's counter-based noise (loom/model/sampling_noise.py): the hash of its
worked example computed by hand, Exp(1) in distribution, never 0 or infinite, the same at a
token whether the row is whole or gathered, and the same on the tests' device as on the CPU."""

from __future__ import annotations

import math

import torch

from loom.core.sampling_params import SamplingParams
from loom.model.sampling_noise import exponential_noise, position_seed, row_keys
from tests.support.placement import DEVICE


def by_hand(key: int, token: int) -> float:
    """The docstring's worked example in Python integers, mod 2^32."""
    m = 0xFFFFFFFF
    x = (key & m) ^ ((token * 0x9E3779B9) & m)
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & m
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & m
    x ^= x >> 16
    return -math.log(((x >> 8) + 0.5) / 2**24)


def test_sampling_noise_is_the_hash_of_its_worked_example() -> None:
    keys = [5, -7, 2**31 - 1, -(2**31)]
    tokens = [0, 3, 1000, 49151]
    noise = exponential_noise(
        torch.tensor(keys, dtype=torch.int32), torch.tensor(tokens, dtype=torch.int32)
    )
    expected = [[by_hand(k, t) for t in tokens] for k in keys]
    torch.testing.assert_close(noise, torch.tensor(expected), rtol=1e-5, atol=1e-6)  # float32


def test_sampling_noise_is_exponential_never_zero_nor_infinite() -> None:
    keys = torch.arange(64, dtype=torch.int32)  # adjacent keys: still independent draws
    noise = exponential_noise(keys, torch.arange(8192, dtype=torch.int32))
    assert bool(torch.isfinite(noise).all())
    assert float(noise.min()) > 0
    assert abs(float(noise.mean()) - 1.0) < 0.01
    assert abs(float((noise > 1).float().mean()) - math.exp(-1)) < 0.005
    rows = noise[:, :4096].reshape(64, -1)
    assert abs(float(torch.corrcoef(rows)[0, 1])) < 0.05


def test_sampling_noise_of_gathered_ids_is_the_whole_row_s() -> None:
    """A row sampled among a few token ids (a grammar's) draws each one's noise of the whole
    row: the narrow race picks what the masked whole row would."""
    keys = torch.tensor([11, 12], dtype=torch.int32)
    whole = exponential_noise(keys, torch.arange(512, dtype=torch.int32))
    ids = torch.tensor([[3, 77, 400], [9, 10, 511]], dtype=torch.int32)
    assert torch.equal(exponential_noise(keys, ids), whole.gather(1, ids.long()))


def test_sampling_noise_is_the_cpu_s_on_the_tests_device() -> None:
    keys = torch.tensor([1, 2, 3], dtype=torch.int32)
    ids = torch.arange(49152, dtype=torch.int32)
    on_device = exponential_noise(keys.to(DEVICE), ids.to(DEVICE)).cpu()
    torch.testing.assert_close(on_device, exponential_noise(keys, ids), rtol=1e-6, atol=0)


def test_sampling_noise_keys_come_from_the_seed_and_position_else_torch_s_generator() -> None:
    params = [SamplingParams(seed=42), SamplingParams(), SamplingParams(seed=42)]
    torch.manual_seed(0)
    first = row_keys(params, [7, 7, 8])
    torch.manual_seed(0)
    again = row_keys(params, [7, 7, 8])
    assert torch.equal(first, again)
    assert int(first[0]) & 0xFFFFFFFF == position_seed(42, 7) & 0xFFFFFFFF
    assert int(first[0]) != int(first[2])  # the next position: another key
    assert int(row_keys(params, [7, 7, 8])[1]) != int(first[1])  # unseeded: drawn anew
