"""Dense torch reference of the DeepSeek-V4.1 DSpark drafter (model-spec §3.12), one request at a time.

Written from ``shared/docs/model-spec.md`` §3.12 (with §3.2 delayed mHC, §3.3 RoPE, §3.4 attention, §3.8 MoE)
only; it imports nothing from ``vllm_deepinfer`` and reuses the loaders and blocks of ``dense_v41.py``
(its own independent V4.1 reference), whose ``hidden(trace=...)`` yields the target's streams.

    context features  a_L(t) = mean_j X_j(t) entering target layer L, L in dspark_target_layer_ids
    main_x            = RMSNorm_{mtp.0.main_norm}(concat_L a_L · mtp.0.main_projᵀ)
    stage i keys      = RoPE_main(RMSNorm_{kv_norm}(main_x · wkv_iᵀ)) at the context positions, plus the
                        block's own keys; every block query sees the last W context positions and the whole block
    block             = [anchor, noise...] at positions P+1..P+N through 3 delayed-mHC V4.1 blocks
                        (m = 0, main RoPE, dspark_n_routed_experts / dspark_num_experts_per_tok MoE)
    h                 = sum_j pi_j X_j with the last FFN pre; U = RMSNorm_{mtp.2.norm}(h) · headᵀ
    Markov            = logits_k = U_k + markov_embed[prev_k] · markov_headᵀ, greedy, prev_0 = anchor
    confidence        = sigmoid([h_k ; markov_embed[prev_k]] · confidence_head.projᵀ)

Everything in the target's dtype (float32 by default); no caches: the context keys are recomputed from the
features each call. Greedy ties go to the lowest token id. MoE selection uses ``gate.bias_vl`` for ids in
``[image_token_id, image_token_id + 5)`` (§3.8, §7 Q17, with the config's image id): the synthetic tokenizer's
noise id is image id + 1, so the drafted (noise) positions of tiny checkpoints select with ``bias_vl``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.reference.dense_v41 import DenseV41, _Checkpoint, _rmsnorm, _stable_topk_idx

__all__ = ["DenseDSpark"]


class DenseDSpark:
    """``DenseDSpark(DenseV41(ckpt))``; ``.features(ids) -> [T, n_targets, D]``;
    ``.draft(features, anchor, n) -> dict(tokens [n], logits [n, V], confidence [n], hidden [n, D])``."""

    def __init__(self, target: DenseV41):
        self.t = t = target
        c = t.cfg
        self.targets = [int(v) for v in c["dspark_target_layer_ids"]]
        self.n_stages = int(c.get("num_nextn_predict_layers") or 3)
        self.noise = int(c["dspark_noise_token_id"])
        self.block = int(c["dspark_block_size"])
        self.image = int(c.get("image_token_id", -1))
        self.E = int(c.get("dspark_n_routed_experts") or t.E)
        self.K = int(c.get("dspark_num_experts_per_tok") or t.K)
        ck = t.ck = _Checkpoint(t.dir)  # DenseV41's loaders read self.ck
        try:
            last = f"mtp.{self.n_stages - 1}."
            self.main_proj = t._linear("mtp.0.main_proj")
            self.main_norm = t._tensor("mtp.0.main_norm.weight")
            self.norm = t._tensor(last + "norm.weight")
            self.markov_embed = t._tensor(last + "markov_head.embed.weight")
            self.markov_head = t._tensor(last + "markov_head.head.weight")
            self.confidence = t._tensor(last + "confidence_head.proj.weight")
            self.stages = [self._load_stage(i) for i in range(self.n_stages)]
        finally:
            del t.ck
        del ck

    def _load_stage(self, i: int) -> dict:
        t, p = self.t, f"mtp.{i}."
        S = {k: t._tensor(p + n) for k, n in (
            ("attn_norm", "attn_norm.weight"), ("ffn_norm", "ffn_norm.weight"), ("q_norm", "attn.q_norm.weight"),
            ("kv_norm", "attn.kv_norm.weight"), ("sink", "attn.attn_sink"), ("gate", "ffn.gate.weight"),
            ("gate_bias", "ffn.gate.bias"), ("gate_bias_vl", "ffn.gate.bias_vl"))}
        for k in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
            S[k] = t._linear(p + "attn." + k)
        for k in ("w1", "w2", "w3"):
            S["sh_" + k] = t._linear(p + "ffn.shared_experts." + k)
            S[k] = torch.stack([t._linear(p + f"ffn.experts.{e}.{k}") for e in range(self.E)])
        for s in ("attn", "ffn"):
            for k in ("fn", "base", "scale"):
                S[f"hc_{s}_{k}"] = t._tensor(p + f"hc_{s}_{k}")
        return S

    # -- context --------------------------------------------------------------------------------
    @torch.no_grad()
    def features(self, token_ids: list[int]) -> torch.Tensor:
        """[T, n_targets, D]: the mean of the 4 streams entering each target layer, for every token."""
        trace: dict = {}
        self.t.hidden(token_ids, trace)
        return torch.stack([trace["streams"][l].mean(1) for l in self.targets], dim=1)

    # -- one stage ------------------------------------------------------------------------------
    def _attention(self, S: dict, x: torch.Tensor, pos: torch.Tensor, main_x: torch.Tensor,
                   ctx_pos: torch.Tensor) -> torch.Tensor:
        """x [N, D] block inputs at pos [N]; main_x [C, D] context features at ctx_pos [C] -> [N, D]."""
        t = self.t
        n, rope = x.shape[0], t.rope_main
        q = rope.apply((_rmsnorm(x @ S["wq_a"].T, S["q_norm"], t.eps) @ S["wq_b"].T).view(n, t.H, t.d), pos)
        keys = torch.cat([rope.apply(_rmsnorm(main_x @ S["wkv"].T, S["kv_norm"], t.eps), ctx_pos),
                          rope.apply(_rmsnorm(x @ S["wkv"].T, S["kv_norm"], t.eps), pos)])    # [C + N, d]
        logits = torch.einsum("nhd,kd->nhk", q, keys) * t.d ** -0.5
        logits = torch.cat([logits, S["sink"].view(1, t.H, 1).expand(n, t.H, 1)], dim=-1)   # the sink key
        o = torch.einsum("nhk,kd->nhd", torch.softmax(logits, dim=-1)[..., :-1], keys)
        o = rope.apply(o, pos, inverse=True).reshape(n, t.G, -1)
        z = torch.einsum("ngi,goi->ngo", o, S["wo_a"].view(t.G, t.Ro, -1)).reshape(n, t.G * t.Ro)
        return z @ S["wo_b"].T

    def _moe(self, S: dict, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """§3.8 with the draft expert counts; ids in [image_token_id, +5) select with gate.bias_vl."""
        t = self.t
        s = torch.sqrt(F.softplus(x @ S["gate"].T))
        image = (ids >= self.image) & (ids < self.image + 5)
        top = _stable_topk_idx(s + torch.where(image.unsqueeze(1), S["gate_bias_vl"], S["gate_bias"]), self.K)
        g = s.gather(1, top)
        g = g / g.sum(-1, keepdim=True) * t.rsf
        y = t._swiglu(x, S["sh_w1"], S["sh_w2"], S["sh_w3"])
        for row in range(x.shape[0]):
            for slot in range(self.K):
                e = int(top[row, slot])
                y[row] += g[row, slot] * t._swiglu(x[row:row + 1], S["w1"][e], S["w2"][e], S["w3"][e])[0]
        return y

    # -- the draft ------------------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, features: torch.Tensor, anchor: int, n: int | None = None) -> dict:
        """Greedy block after `anchor` at position P+1 = len(features) (features of positions 0..P)."""
        t = self.t
        n = n or self.block
        p1 = features.shape[0]
        lo = max(0, p1 - t.W)
        ctx_pos = torch.arange(lo, p1)
        main_x = _rmsnorm(features[lo:].reshape(p1 - lo, -1) @ self.main_proj.T, self.main_norm, t.eps)
        pos = torch.arange(p1, p1 + n)
        ids = torch.tensor([anchor] + [self.noise] * (n - 1))
        X = t.embed[ids].unsqueeze(1).expand(n, t.hc, t.D).contiguous()
        pi = None  # stage 0's attention input is the embedding itself
        for S in self.stages:
            pre, post, C = t._hc_coeffs(X, S["hc_attn_fn"], S["hc_attn_base"], S["hc_attn_scale"])
            u = X[:, 0] if pi is None else (pi.unsqueeze(-1) * X).sum(1)
            X = t._hc_post(X, self._attention(S, _rmsnorm(u, S["attn_norm"], t.eps), pos, main_x, ctx_pos), post, C)
            pi = pre
            pre, post, C = t._hc_coeffs(X, S["hc_ffn_fn"], S["hc_ffn_base"], S["hc_ffn_scale"])
            u = (pi.unsqueeze(-1) * X).sum(1)
            X = t._hc_post(X, self._moe(S, _rmsnorm(u, S["ffn_norm"], t.eps), ids), post, C)
            pi = pre
        h = (pi.unsqueeze(-1) * X).sum(1)                                          # [n, D] pre-norm
        base = _rmsnorm(h, self.norm, t.eps) @ t.head.T
        prev, tokens, logits, psis = anchor, [], [], []
        for k in range(n):
            psi = self.markov_embed[prev]
            lk = base[k] + self.markov_head @ psi
            prev = int(_stable_topk_idx(lk, 1)[0])
            tokens.append(prev)
            logits.append(lk)
            psis.append(psi)
        psi = torch.stack(psis)
        confidence = torch.sigmoid(torch.cat([h, psi], dim=-1) @ self.confidence.T).squeeze(-1)
        return {"tokens": tokens, "logits": torch.stack(logits), "confidence": confidence, "hidden": h}
