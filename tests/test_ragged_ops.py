"""Varlen prefill ops of `vllm_deepinfer.ops.reference` against their per-request definitions."""

import torch

from vllm_deepinfer.ops import reference as ref


def test_indexer_scores_ragged_matches_per_span_scores(monkeypatch):
    """Each token scores only its own rows, for any token tile."""
    torch.manual_seed(0)
    spans = [(5, 9), (3, 0), (8, 30)]  # (tokens, rows of the span)
    q = torch.randn(16, 4, 32)
    w = torch.randn(16, 4)
    keys = torch.randn(39, 32)
    start, count, r0 = [], [], 0
    for n_tok, n_rows in spans:
        start += [r0] * n_tok
        count += torch.randint(0, n_rows + 1, (n_tok,)).tolist()
        r0 += n_rows
    for elems in (1, 3000, 1 << 24):  # one token per tile, a few tiles, one tile
        monkeypatch.setattr(ref, "TILE_ELEMS", elems)
        out = ref.indexer_scores_ragged(q, w, keys, torch.tensor(start), torch.tensor(count), 30)
        assert out.shape == (16, 30)
        for t in range(16):
            n = count[t]
            want = ref.indexer_scores(q[t:t + 1], w[t:t + 1], keys[start[t]:start[t] + n])[0]
            torch.testing.assert_close(out[t, :n], want, rtol=1e-6, atol=1e-6)
            assert torch.isneginf(out[t, n:]).all()


def test_sparse_attention_indexed_tiles_match_masked_attention(monkeypatch):
    """The token-tiled gather reference equals masked attention over the shared rows (any tile size)."""
    torch.manual_seed(1)
    t, h, d, r, k = 23, 4, 16, 50, 9
    q, kv, sink = torch.randn(t, h, d), torch.randn(r, d), torch.randn(h)
    idx = torch.stack([torch.randperm(r)[:k] for _ in range(t)])
    idx[torch.rand(t, k) < 0.3] = -1
    idx[5] = -1  # a query with no keys: all mass on the sink, output 0
    allowed = torch.zeros(t, r + 1, dtype=torch.bool).scatter_(1, torch.where(idx >= 0, idx, r), True)[:, :r]
    want = ref.sparse_attention(q, kv, allowed, sink, 0.3)
    for elems in (1, 200, 1 << 24):  # one token per tile, a few tiles, one tile
        monkeypatch.setattr(ref, "TILE_ELEMS", elems)
        torch.testing.assert_close(ref.sparse_attention_indexed(q, kv, idx, sink, 0.3), want, rtol=1e-5, atol=1e-6)
    assert ref.sparse_attention_indexed(q, kv, idx, sink, 0.3)[5].abs().max() == 0


def test_flashmla_compact_indices_keep_each_tokens_keys():
    """`ops.flashmla.compact_indices`: a row's valid ids first (same order), `topk_length` counts them, width a
    multiple of 128; attention over the first `topk_length` compacted ids equals attention over the original ids."""
    from vllm_deepinfer.ops import flashmla

    torch.manual_seed(0)
    t, k, rows = 6, 150, 40
    idx = torch.randint(0, rows, (t, k))
    idx = torch.where(torch.rand(t, k) < 0.4, -1, idx)
    idx[1] = -1  # a token with no key
    ids, lens = flashmla.compact_indices(idx)
    assert ids.shape == (t, 256) and ids.dtype == torch.int32 and lens.dtype == torch.int32
    q, kv, sink = torch.randn(t, 4, 16), torch.randn(rows, 16), torch.randn(4)
    want = ref.sparse_attention_indexed(q, kv, idx, sink, 0.25)
    for i in range(t):
        n = int(lens[i])
        assert ids[i, :n].tolist() == idx[i][idx[i] >= 0].tolist() and (ids[i, n:] == -1).all()
        got = ref.sparse_attention_indexed(q[i:i + 1], kv, ids[i:i + 1, :n].long(), sink, 0.25)
        torch.testing.assert_close(got, want[i:i + 1], rtol=1e-5, atol=1e-6)
