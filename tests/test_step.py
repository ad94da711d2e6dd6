"""Host-side span arithmetic of `StepBatch` (no device reads on the prefill path)."""

import torch

from vllm_deepinfer.models.step import RequestSpan


def test_closed_groups_and_last_pos_match_the_positions():
    for m in (1, 2, 4, 128):
        for first in range(0, 300, 7):
            for n in (1, 2, 3, 5, 64, 200):
                span = RequestSpan(req=0, start=10, end=10 + n, first_pos=first)
                pos = torch.arange(first, first + n)
                assert span.last_pos == int(pos[-1])
                assert list(span.closed_groups(m)) == (pos[(pos + 1) % m == 0] // m).tolist()


SPANS = [(3, 0, 5, 0), (7, 5, 6, 9), (1, 6, 40, 100), (4, 40, 43, 2)]  # (req, start, end, first_pos): odd mixes


def _layout():
    from vllm_deepinfer.models.step import PrefillLayout

    spans = [RequestSpan(*s) for s in SPANS]
    return spans, PrefillLayout.build(spans, torch.device("cpu"))


def test_prefill_layout_tokens():
    spans, pf = _layout()
    assert (pf.start, pf.end, pf.n_tokens) == (0, 43, 43)
    for s in spans:
        assert pf.req[s.start:s.end].tolist() == [s.req] * (s.end - s.start)
        assert pf.pos[s.start:s.end].tolist() == list(range(s.first_pos, s.last_pos + 1))


def test_prefill_window_ids_address_each_tokens_own_positions():
    """Packed window row base[t] + p holds (request, p) for every p in [lo[t], pos]; lo = max(pos - W + 1, 0)."""
    spans, pf = _layout()
    for w in (1, 4, 16):
        win = pf.window(w)
        assert win.n_rows == sum(s.last_pos - s.window_floor(w) + 1 for s in spans)
        for s in spans:
            for t in range(s.start, s.end):
                p = int(pf.pos[t])
                assert int(win.lo[t]) == max(p - w + 1, 0)
                for q in range(int(win.lo[t]), p + 1):
                    r = int(win.base[t]) + q
                    assert (int(win.row_req[r]), int(win.row_pos[r])) == (s.req, q)


def test_prefill_compressed_rows_and_closed_groups():
    spans, pf = _layout()
    for m in (1, 2, 4, 128):
        c = pf.compressed(m)
        assert c.n_cols == max((s.last_pos + 1) // m for s in spans)
        for s in spans:
            n_rows = (s.last_pos + 1) // m
            for t in range(s.start, s.end):
                assert int(c.n_visible[t]) == (int(pf.pos[t]) + 1) // m and int(c.n_rows[t]) == n_rows
                b = int(c.base[t])
                assert c.row_req[b:b + n_rows].tolist() == [s.req] * n_rows
                assert c.row_id[b:b + n_rows].tolist() == list(range(n_rows))
        req, g = pf.closed(m)
        want = [(s.req, x) for s in spans for x in s.closed_groups(m)]
        assert list(zip(req.tolist(), g.tolist())) == want


def test_retained_sub_batch_keeps_decodes_and_span_tails():
    """Bounded replay: one-token requests stay first, each span keeps its positions among its prompt's
    last `keep` (a span entirely below them drops out), published top-k rows follow their tokens, the
    sub-batch keeps the layer's window floor and the next layer's batch gets the new one."""
    from vllm_deepinfer.models.step import StepBatch

    # 2 decodes, then spans at positions 100..109 (prompt 115, keep 10: from 105), 0..4 (prompt 50: from
    # 40), 50..55 (prompt 30: from 20), 7..8 (prompt logprobs: never replayed)
    positions = torch.tensor([300, 301] + list(range(100, 110)) + list(range(5)) + list(range(50, 56)) + [7, 8])
    spans = [RequestSpan(2, 2, 12, 100, 115), RequestSpan(3, 12, 17, 0, 50), RequestSpan(4, 17, 23, 50, 30),
             RequestSpan(5, 23, 25, 7, -1)]
    batch = StepBatch(positions * 10, positions, spans, None, n_dec=2, req=torch.arange(2),
                      live=torch.ones(2, dtype=torch.bool), topk={6: positions.unsqueeze(1)}, replay_keep=40)
    kept = batch.retained(10)
    assert kept.rows.tolist() == [0, 1] + list(range(7, 12)) + list(range(17, 25))
    assert kept.batch.positions.tolist() == [300, 301] + list(range(105, 110)) + list(range(50, 56)) + [7, 8]
    assert kept.batch.token_ids.tolist() == (kept.batch.positions * 10).tolist()
    assert kept.batch.topk[6].squeeze(1).tolist() == kept.batch.positions.tolist()
    assert [(s.req, s.start, s.end, s.first_pos, s.prompt_len) for s in kept.batch.spans] == [
        (2, 2, 7, 105, 115), (4, 7, 13, 50, 30), (5, 13, 15, 7, -1)]
    assert kept.batch.replay_keep == 40 and kept.batch.with_replay_keep(10).replay_keep == 10
    # window floors: the layer's keep (40) bounds request 2 at 75; request 5 (no replay) only by its window
    assert [s.window_floor(16, 40) for s in kept.batch.spans] == [90, 35, 0]
    assert [s.window_floor(16) for s in kept.batch.spans] == [90, 35, 0]
    assert [s.window_floor(40, 40) for s in kept.batch.spans] == [75, 11, 0]
    assert StepBatch(positions, positions, spans[2:], None, n_dec=2).retained(10) is None  # nothing dropped


def _per_token(counts: list[int], seq_lens: list[int], t: int):
    """StepBatch of a per-token step: requests with `counts` query tokens, `t` tokens (graph padding after)."""
    from vllm_deepinfer.attention.backend import PagedCacheMetadata
    from vllm_deepinfer.models.step import StepBatch

    r = len(counts)
    qsl = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    meta = PagedCacheMetadata(torch.arange(1, r + 1, dtype=torch.int32).view(r, 1), qsl, torch.tensor(seq_lens),
                              64, r, sum(counts), True, 128, qsl)
    positions = torch.zeros(t, dtype=torch.long)
    return StepBatch.from_metadata(positions, positions, {"layers.0.window_cache": meta})


def test_verification_step_takes_the_per_token_path_with_padding_dead():
    """Verification of 2 drafts for 3 requests, graph-padded to 4 requests / 12 tokens: each token finds its
    request from the device query offsets, the padding request (no token, length 0) is not live, no span."""
    batch = _per_token([3, 3, 3, 0], [20, 7, 33, 0], 12)
    assert batch.spans == [] and batch.prefill is None and batch.n_dec == 12
    assert batch.req.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert batch.live.tolist() == [True] * 9 + [False] * 3


def test_varlen_and_decode_steps_take_the_per_token_path():
    """Trimmed drafts (1, 4, 2 tokens) and plain decode (one token each, two tokens of padding past the last
    request): the tokens beyond the step's last offset are dead even where no padding request exists."""
    varlen = _per_token([1, 4, 2], [9, 40, 12], 7)
    assert varlen.req.tolist() == [0, 1, 1, 1, 1, 2, 2] and all(varlen.live.tolist())
    decode = _per_token([1, 1, 1], [5, 6, 7], 5)
    assert decode.req.tolist() == [0, 1, 2, 2, 2] and decode.live.tolist() == [True, True, True, False, False]
