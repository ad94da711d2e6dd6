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
