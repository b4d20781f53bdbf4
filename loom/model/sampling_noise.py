"""The exponential race's noise, counter-based: each (row key, token id) pair hashed to its own
Exp(1) draw, on whatever device the logits are, in one batched pass.

Sampling by the exponential race takes `argmax(p / q)` with `q ~ Exp(1)` drawn independently
for every token: it equals sampling from `p`. Here `q` is not drawn from a generator but
computed: a row's 32-bit key (a seeded request's: from its seed and the position of the token
it samples; any other's: drawn at random each step) and the token id go through a 32-bit
integer hash (murmur3's finalizer), whose top 24 bits make a uniform `u` in (0, 1), and
`q = -log(u)`. So a seeded row's draw depends on its seed, its position and the token ids
alone: not on which rows share its batch, how wide their gathered logits are, nor the device
(the same key gives the same noise on a CPU and a GPU), and a row sampled among the few
tokens its grammar allows draws, for each of them, exactly the noise the full row would.

Worked example: key 5, token 3: x = 5 ^ (3 * 0x9E3779B9 mod 2^32); x ^= x >> 16;
x *= 0x85EBCA6B; x ^= x >> 13; x *= 0xC2B2AE35; x ^= x >> 16 (all mod 2^32, shifts logical);
u = ((x >> 8) + 0.5) / 2^24; q = -log(u). On 2 cores of an AMD EPYC (Zen 5), alone, 64 rows of
49,152 tokens took 14 ms, against 45 ms for torch's `exponential_` (measured in one run).
"""

from __future__ import annotations

import torch

from loom.core.sampling_params import SamplingParams

MASK_64 = (1 << 64) - 1
GOLDEN = 0x9E3779B9
MIX_1 = 0x85EBCA6B
MIX_2 = 0xC2B2AE35


def signed32(value: int) -> int:
    """An unsigned 32-bit value as the int32 with the same bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


def shifted(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int32 `x` (torch's `>>` keeps the sign)."""
    return (x >> bits) & ((1 << (32 - bits)) - 1)


def exponential_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise [N, W] float32 for row keys [N] int32 and token ids [W] or [N, W] int32."""
    ids = token_ids if token_ids.dim() == 2 else token_ids[None, :]
    x = keys[:, None] ^ (ids * signed32(GOLDEN))
    x = (x ^ shifted(x, 16)) * signed32(MIX_1)
    x = (x ^ shifted(x, 13)) * signed32(MIX_2)
    x = x ^ shifted(x, 16)
    uniform = (shifted(x, 8).float() + 0.5) * (2.0**-24)  # in (0, 1): q is never 0 nor inf
    return -torch.log(uniform)


def row_keys(params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    """Each row's key, int32 on the CPU: a seeded row's from its seed and position (splitmix64
    of both, its low 32 bits), any other's drawn from torch's generator."""
    keys = torch.randint(-(1 << 31), (1 << 31) - 1, (len(params),), dtype=torch.int32)
    for i, (p, position) in enumerate(zip(params, positions, strict=True)):
        if p.seed is not None:
            keys[i] = signed32(position_seed(p.seed, position) & 0xFFFFFFFF)
    return keys


def position_seed(seed: int, position: int) -> int:
    """A 64-bit seed for a seeded request's token at `position` (splitmix64 of both)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK_64
    return z ^ (z >> 31)
