"""Target-side hook of speculative decoding: the residual streams entering chosen layers.

DSpark (model-spec §3.12.1) reads, for every token the target processes, the plain mean of the h streams
entering each of its target layers. The model calls `record` before running each layer only while a
capture is installed (`DeepseekForCausalLM.enable_stream_capture`); with speculation off the forward
holds `capture = None` and does nothing extra.
"""

from __future__ import annotations

import torch


class StreamCapture:
    """`features` [max_tokens, len(layers), D]: row t, column i = mean_j X_j of token t entering layers[i]
    in the last forward (rows >= `n_tokens` are stale). `valid` [max_tokens]: the token reached the first
    captured layer (bounded replay runs the layers past the cut on a prompt's last `keep` tokens only;
    the other rows stay 0 and invalid)."""

    def __init__(self, layers: tuple[int, ...], max_tokens: int, hidden: int, dtype: torch.dtype,
                 device: torch.device):
        self.layers = tuple(layers)
        self._column = {l: i for i, l in enumerate(self.layers)}
        self.features = torch.zeros(max_tokens, len(self.layers), hidden, dtype=dtype, device=device)
        self.valid = torch.zeros(max_tokens, dtype=torch.bool, device=device)
        self.n_tokens = 0

    def record(self, layer: int, streams: torch.Tensor, rows: torch.Tensor | None) -> None:
        """streams: [T', h, D] entering `layer`; rows: [T'] their token indices in the step (None: all)."""
        if layer == 0:
            self.n_tokens = streams.shape[0]
            self.features[: self.n_tokens].zero_()
            self.valid[: self.n_tokens] = False
        column = self._column.get(layer)
        if column is None:
            return
        mean = streams.float().mean(1).to(self.features.dtype)
        if rows is None:
            self.features[: mean.shape[0], column] = mean
            if column == 0:
                self.valid[: mean.shape[0]] = True
            return
        self.features[:, column].index_copy_(0, rows, mean)
        if column == 0:
            self.valid.index_fill_(0, rows, True)
