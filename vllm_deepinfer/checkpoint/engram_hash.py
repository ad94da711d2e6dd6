"""Engram n-gram hash layout of DeepSeek-V4.1 (model-spec §3.9).

Public API::

    normalize_token_text(text) -> str
    compressed_token_map(tokenizer_or_path) -> np.ndarray[int64]      # token id -> compressed id
    compressed_vocab_size(tokenizer_or_path) -> int                   # number of distinct keys
    is_prime(n) -> bool
    bucket_primes(engram_vocab_size, n_heads, max_ngram, n_layers) -> list[list[int]]
    bucket_offsets(primes) -> list[list[int]]                         # prefix sums per layer
    engram_num_embeddings(engram_vocab_size, n_heads, max_ngram, n_layers) -> list[int]
    hash_multipliers(layer_id, compressed_vocab_size, max_ngram) -> list[int]
    hash_ids(compressed_ids, layer_id, primes_row, offsets_row, multipliers, n_heads, max_ngram, pad_id, dead=None)
        -> np.ndarray[int64] [T, (max_ngram-1)*n_heads]               # reference (NumPy) hashing

Columns of a layer are ordered ``c = (o - 2) * n_heads + head`` for n-gram order ``o = 2..max_ngram``.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

__all__ = [
    "normalize_token_text", "compressed_token_map", "compressed_vocab_size", "is_prime",
    "bucket_primes", "bucket_offsets", "engram_num_embeddings", "hash_multipliers", "hash_ids",
]

_INT64_MAX = (1 << 63) - 1
_SPACE_GUARD = "\ue000"  # private-use stand-in that protects a lone " " from the strip step

_NORMALIZER = None


def _normalizer():
    """The §3.9 text normalisation, built from `tokenizers` normaliser components (Rust semantics)."""
    global _NORMALIZER
    if _NORMALIZER is None:
        from tokenizers import Regex, normalizers

        _NORMALIZER = normalizers.Sequence([
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SPACE_GUARD),
            normalizers.Strip(),
            normalizers.Replace(_SPACE_GUARD, " "),
        ])
    return _NORMALIZER


def normalize_token_text(text: str) -> str:
    """NFKC -> NFD -> strip accents -> lowercase -> collapse [ \\t\\r\\n]+ to " " -> strip (a string that is
    exactly one space is kept); an empty result falls back to the original text."""
    out = _normalizer().normalize_str(text)
    return out if out else text


def _load_tokenizer(tokenizer_or_path: Any):
    if isinstance(tokenizer_or_path, (str, os.PathLike)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer_or_path))
    return tokenizer_or_path


def _backend(tok: Any):
    """The raw `tokenizers.Tokenizer` of a fast HF tokenizer (or the object itself)."""
    from tokenizers import Tokenizer

    if isinstance(tok, Tokenizer):
        return tok
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise TypeError("Engram needs a fast tokenizer exposing `backend_tokenizer`")
    return backend


def _token_count(tok: Any, backend) -> int:
    try:
        return len(tok)
    except TypeError:
        return backend.get_vocab_size(with_added_tokens=True)


def compressed_token_map(tokenizer_or_path: Any) -> np.ndarray:
    """Token id -> compressed id (int64 array of length ``len(tokenizer)``), §3.9.

    Each token is decoded alone with the raw backend (special tokens kept). Partial UTF-8 byte tokens
    (decoded text contains U+FFFD) are keyed by their raw token string, all others by the normalised
    text. Keys are numbered in order of first appearance, so ``map.max() + 1`` is the
    ``engram_compressed_vocab_size``.
    """
    tok = _load_tokenizer(tokenizer_or_path)
    backend = _backend(tok)
    n = _token_count(tok, backend)
    keys: dict[str, int] = {}
    out = np.empty(n, dtype=np.int64)
    for tid in range(n):
        text = backend.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(tid)
        else:
            key = normalize_token_text(text)
        out[tid] = keys.setdefault(key, len(keys))
    return out


def compressed_vocab_size(tokenizer_or_path: Any) -> int:
    """Number of distinct normalisation keys (`engram_compressed_vocab_size`)."""
    m = compressed_token_map(tokenizer_or_path)
    return int(m.max()) + 1 if len(m) else 0


# ------------------------------------------------------------------------------------- primes
def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin primality test (exact for all n < 3.3e24)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in small:
        x = pow(a, d, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def bucket_primes(engram_vocab_size: int, n_heads: int, max_ngram: int, n_layers: int) -> list[list[int]]:
    """Bucket sizes per Engram layer: ``n_layers`` rows of ``(max_ngram-1) * n_heads`` primes.

    For every layer and n-gram order the search restarts just below ``engram_vocab_size`` and takes,
    head by head, the next prime above the current value that no earlier (layer, order, head) used.
    """
    used: set[int] = set()
    rows: list[list[int]] = []
    for _ in range(n_layers):
        row: list[int] = []
        for _order in range(2, max_ngram + 1):
            cur = engram_vocab_size - 1
            for _h in range(n_heads):
                cur += 1
                while cur in used or not is_prime(cur):
                    cur += 1
                used.add(cur)
                row.append(cur)
        rows.append(row)
    return rows


def bucket_offsets(primes: Sequence[Sequence[int]]) -> list[list[int]]:
    """Start row of each (order, head) bucket range inside its layer's table (exclusive prefix sums)."""
    out = []
    for row in primes:
        acc, offs = 0, []
        for p in row:
            offs.append(acc)
            acc += int(p)
        out.append(offs)
    return out


def engram_num_embeddings(engram_vocab_size: int, n_heads: int, max_ngram: int, n_layers: int) -> list[int]:
    """Rows of each Engram table (= sum of its bucket primes), the `engram_num_embeddings` config field."""
    return [sum(r) for r in bucket_primes(engram_vocab_size, n_heads, max_ngram, n_layers)]


# ------------------------------------------------------------------------------------- hashing
def hash_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram: int) -> list[int]:
    """Odd multipliers of Engram layer `layer_id` (the backbone layer id, not the table index).

    ``bound = max(1, (2**63-1) // compressed_vocab_size // 2)``; ``max_ngram`` int64 draws in ``[0, bound)``
    from ``numpy.random.default_rng(10007 * layer_id)``, each mapped to ``2z + 1``.
    """
    bound = max(1, (_INT64_MAX // int(compressed_vocab_size)) // 2)
    rng = np.random.default_rng(10007 * int(layer_id))
    z = rng.integers(0, bound, size=(int(max_ngram),), dtype=np.int64)
    return [int(v) * 2 + 1 for v in z]


def hash_ids(compressed_ids: Sequence[int], layer_id: int, primes_row: Sequence[int], offsets_row: Sequence[int],
             multipliers: Sequence[int], n_heads: int, max_ngram: int, pad_id: int,
             dead: Sequence[bool] | None = None, history: Sequence[int] = ()) -> np.ndarray:
    """Reference hash ids ``[T, (max_ngram-1)*n_heads]`` (int64) for one layer, §3.9.

    ``compressed_ids``: compressed ids of the sequence (already mapped); ``history``: compressed ids of
    up to ``max_ngram-1`` tokens before it (chunk look-back); ``dead[t]`` marks image-span tokens. A dead
    or out-of-range look-back position and every older one hash as ``pad_id`` (compressed pad id).
    ``layer_id`` is only used to document which multipliers belong here.
    """
    del layer_id
    ids = list(history) + list(compressed_ids)
    dead_all = [False] * len(history) + (list(dead) if dead is not None else [False] * len(compressed_ids))
    start = len(history)
    t_len = len(compressed_ids)
    n_cols = (max_ngram - 1) * n_heads
    out = np.zeros((t_len, n_cols), dtype=np.int64)
    for t in range(t_len):
        p = start + t
        vals, alive = [], True
        for s in range(max_ngram):
            q = p - s
            if alive and (q < 0 or dead_all[q]):
                alive = False
            vals.append(ids[q] if alive else pad_id)
        acc = 0
        for s in range(max_ngram):
            acc ^= int(vals[s]) * int(multipliers[s])
            acc &= (1 << 64) - 1
            if s >= 1:
                for h in range(n_heads):
                    c = (s - 1) * n_heads + h
                    # int64 semantics: all terms are non-negative and < 2**63 by construction of the bound
                    out[t, c] = (acc % int(primes_row[c])) + int(offsets_row[c])
    return out
