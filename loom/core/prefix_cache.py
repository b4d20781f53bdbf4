"""Content addresses for full KV blocks: what prefix caching shares blocks by.

A block's hash is chained over its parent block's hash and its own token ids, so equal hashes
mean equal tokens at equal positions from the first token on (the scheme of vLLM v1 and
nano-vllm). The hash is BLAKE2b-256 keyed with a secret drawn when the process starts: a client
cannot compute any block's hash, so it can neither find nor steer a collision, and never
receives K/V computed from another client's different text. Hashes live only in this process.

A request's tenant and `cache_salt` go into its first block's hash: requests of different
tenants, or with different salts, share no block (a cache hit shows in the time to first token
and in a request's cached tokens, so no tenant can probe another's prompts, and a client who
must not be probed by others of its own tenant sends a salt of its own).
"""

from __future__ import annotations

import hashlib
import os
from array import array

from loom.core.block_manager import BlockManager
from loom.core.kv_events import StoredBlock
from loom.core.request import Request

SECRET = os.urandom(32)


def root_hash(tenant: str, salt: str) -> bytes:
    """The first block's parent: the tenant and the salt, alone."""
    name = tenant.encode()
    return blake2b(b"salt\0" + len(name).to_bytes(4, "big") + name + salt.encode())


def blake2b(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32, key=SECRET).digest()


def block_hashes(request: Request, block_size: int, num_tokens: int) -> list[bytes]:
    """The hashes of the request's full blocks within its first `num_tokens` tokens (prompt,
    then output). Kept on the request and extended as it grows: each block is hashed once."""
    hashes = request.block_hashes
    parent = hashes[-1] if hashes else root_hash(request.tenant, request.cache_salt)
    for start in range(len(hashes) * block_size, num_tokens - block_size + 1, block_size):
        tokens = array("i", request.token_ids(start, start + block_size))
        parent = blake2b(parent + tokens.tobytes())
        hashes.append(parent)
    return hashes[: num_tokens // block_size]


def cached_prefix(blocks: BlockManager, request: Request) -> list[int]:
    """The cached blocks a waiting request can take: whole blocks, never the one with its last
    token (a step must compute at least one token to sample from). None for a request that
    scores its prompt or means its hidden states: every position is computed then."""
    pooling = request.sampling.pooling
    every = request.sampling.prompt_logprobs is not None
    if not blocks.enable_caching or every or (pooling is not None and pooling.kind == "mean"):
        return []
    num_tokens = request.num_tokens - 1
    return blocks.cached_prefix(block_hashes(request, blocks.block_size, num_tokens))


def cache_full_blocks(
    blocks: BlockManager, request: Request, num_computed_before: int, num_done: int | None = None
) -> None:
    """Offer the blocks that a step filled (its K/V written: of its first `num_done` tokens,
    all it computed by default) to the prefix cache. Most decode steps fill none: they return
    at once."""
    num_done = request.num_computed_tokens if num_done is None else num_done
    first = num_computed_before // blocks.block_size
    end = num_done // blocks.block_size
    if not blocks.enable_caching or end <= first:
        return
    hashes = block_hashes(request, blocks.block_size, num_done)
    size = blocks.block_size
    for i in blocks.cache(request.request_id, first, hashes[first:end]):
        index = first + i
        blocks.events.stored(
            StoredBlock(
                block_hash=hashes[index],
                parent_hash=hashes[index - 1] if index else None,
                token_ids=tuple(request.token_ids(index * size, (index + 1) * size)),
                tenant=request.tenant,
                salted=bool(request.cache_salt),
            )
        )
