"""Chained XXH3-128 hashes over fixed-size units of tokens.

h_i = H(h_{i-1} || tokens of unit i), with h_{-1} a domain key derived from the domain name
("kv" or "linear"), the unit stride and the model/state fingerprint. Two domains, strides or
fingerprints therefore never produce the same chain. Hashes are Python ints (128 bit).
"""
from array import array
from functools import lru_cache

import xxhash

KV_DOMAIN = "kv"
LINEAR_DOMAIN = "linear"


@lru_cache(maxsize=64)
def domain_seed(domain: str, stride: int, fingerprint: str = "") -> int:
    key = f"gdn-jax/prefix-cache/{domain}/stride={stride}/fingerprint={fingerprint}"
    return xxhash.xxh3_128_intdigest(key.encode())


def hash_unit(prev: int, tokens) -> int:
    return xxhash.xxh3_128_intdigest(prev.to_bytes(16, "little") + array("q", tokens).tobytes())


def extend_chain(chain: list[int], token_ids: list[int], stride: int, seed: int) -> None:
    """Append the hash of every whole unit of `token_ids` not yet in `chain` (in place)."""
    n = len(chain)
    prev = chain[-1] if n else seed
    while (n + 1) * stride <= len(token_ids):
        prev = hash_unit(prev, token_ids[n * stride:(n + 1) * stride])
        chain.append(prev)
        n += 1


def chain_hashes(token_ids: list[int], stride: int, seed: int) -> list[int]:
    chain: list[int] = []
    extend_chain(chain, token_ids, stride, seed)
    return chain
