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


def test_retained_sub_batch_keeps_decodes_and_span_tails():
    """Bounded replay: one-token requests stay first, each span keeps its positions >= replay_from
    (a span entirely below it drops out), published top-k rows follow their tokens."""
    from vllm_deepinfer.models.step import StepBatch

    # 2 decodes, then spans at positions 100..109 (replay from 105), 0..4 (from 40), 50..55 (from 20)
    positions = torch.tensor([300, 301] + list(range(100, 110)) + list(range(5)) + list(range(50, 56)))
    spans = [RequestSpan(2, 2, 12, 100, 105), RequestSpan(3, 12, 17, 0, 40), RequestSpan(4, 17, 23, 50, 20)]
    batch = StepBatch(positions * 10, positions, spans, None, n_dec=2, req=torch.arange(2),
                      live=torch.ones(2, dtype=torch.bool), topk={6: positions.unsqueeze(1)})
    kept = batch.retained()
    assert kept.rows.tolist() == [0, 1] + list(range(7, 12)) + list(range(17, 23))
    assert kept.batch.positions.tolist() == [300, 301] + list(range(105, 110)) + list(range(50, 56))
    assert kept.batch.token_ids.tolist() == (kept.batch.positions * 10).tolist()
    assert kept.batch.topk[6].squeeze(1).tolist() == kept.batch.positions.tolist()
    assert [(s.req, s.start, s.end, s.first_pos, s.replay_from) for s in kept.batch.spans] == [
        (2, 2, 7, 105, 105), (4, 7, 13, 50, 20)]
    assert StepBatch(positions, positions, spans[2:], None, n_dec=2).retained() is None  # nothing dropped
