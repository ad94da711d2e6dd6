"""Adapter: a DeepSeek-V4-Flash checkpoint (real DeepSeek layout) in Hugging Face
``transformers.DeepseekV4ForCausalLM`` (transformers 5.19, CPU, eager).

HF's implementation is independent of the plugin and of :mod:`tests.reference.dense_v41`;
this module only loads a checkpoint into it and exposes ``logits`` / ``greedy``.
It never imports ``vllm_deepinfer``.

How the checkpoint reaches HF (all of it is HF's own machinery; nothing is renamed here)
    * ``config.json`` is read by ``DeepseekV4Config``, which folds the hub keys:
      ``compress_ratios`` -> ``layer_types`` (0 ``sliding_attention``, 4
      ``compressed_sparse_attention`` = CSA with the lightning indexer, 128
      ``heavily_compressed_attention`` = HCA), truncated to ``num_hidden_layers`` (the MTP
      entry is dropped); ``compress_rates = {csa: 4, hca: 128}``; ``num_hash_layers`` ->
      ``mlp_layer_types``; ``rope_scaling`` + ``rope_theta`` + ``compress_rope_theta`` ->
      ``rope_parameters = {main, compress}`` with YaRN ``attention_factor = 1.0`` on the
      compress table.  The constructor checks that the CSA/HCA layers exist, i.e. that
      HF's compressors and indexer are really built.
    * Tensor names: the ``deepseek_v4`` entry of ``transformers/conversion_mapping.py``
      renames DeepSeek-native names (``layers.{l}.attn.wq_a`` -> ``...self_attn.q_a_proj``,
      ``attn.indexer.compressor.*`` -> ``...compressor.indexer.*``, ``ape`` ->
      ``position_bias``, ``ffn.gate.bias`` -> ``e_score_correction_bias``, ...) and merges the
      per-expert ``w1``/``w3``/``w2`` into ``experts.gate_up_proj`` / ``experts.down_proj``.
      ``mtp.*`` tensors are ignored by HF (``_keys_to_ignore_on_load_unexpected``).
    * Quantisation: the top-level ``quantization_config`` (``quant_method: fp8``,
      ``weight_block_size [128, 128]``, ``scale_fmt: ue8m0``) selects HF's
      ``FineGrainedFP8`` quantizer.  We pass ``FineGrainedFP8Config(dequantize=True, ...)``
      explicitly (on a CPU-only machine HF would switch to dequantisation by itself anyway).
      Its ``update_weight_conversions`` renames every ``<linear>.scale`` to
      ``<linear>.weight_scale_inv`` and prepends ``Fp8Dequantize`` to each converter, which
      (a) decodes FP8 E4M3 weights times the UE8M0 block scales and (b) detects the MXFP4
      experts by their ``int8`` dtype, unpacks two E2M1 nibbles per byte (low nibble first)
      and applies the per-32 scales, deriving the block shape from the scale grid -- so
      ``expert_dtype`` (``fp4``) is not consulted on this path.  Result: plain ``nn.Linear``
      / expert tensors holding the dequantised values.  HF's quantizer refuses to load
      without the ``accelerate`` package; when it is missing (or ``use_hf_quantizer=False``)
      the adapter instead writes a temporary copy of the checkpoint whose quantised
      linears were dequantised by the very same HF op (``Fp8Dequantize._dequantize_one``)
      and whose config has no ``quantization_config``, and loads that (bit-identical
      weights; a test checks both paths agree).
    * dtype: after loading, every floating tensor is cast to ``dtype`` (default float32).
      HF leaves the checkpoint's BF16 tensors (embed, norms, compressor/indexer
      projections, gate) in BF16 and the dequantised ones in the requested dtype, which
      would mix dtypes inside one matmul; the cast is exact (BF16 -> fp32).  FP8/FP4 values
      times power-of-two scales are exactly representable in both BF16 and fp32.
    * ``index_topk``: optional override (e.g. 16, spec §8.5) applied to the config before
      the model is built, so HF's indexer top-k uses it.
    * Missing, unexpected or mismatched keys raise ``RuntimeError`` (spec §8.2: none).

Numerics: HF computes attention, indexer scores and compressors in the model dtype
without FP8 activation/KV simulation.

Top-k ties (the one behaviour this adapter changes): rows whose index heads all ReLU to zero
score exactly 0, so exact ties at the top-k boundary are common with random weights. The spec
leaves tie order implementation-defined (§7 Q18); ``torch.topk`` picks an arbitrary member.
During HF's forward this adapter makes ``Tensor.topk`` a stable sort (equal scores -> lower
index first), the order the plugin and the dense V4.1 reference use. Values are unchanged.

API: ``HFV4(ckpt_dir, dtype=torch.float32, index_topk=None, use_hf_quantizer=None)``;
``.logits(ids) -> [T, V]`` (one full-sequence forward, float32);
``.greedy(prompt_ids, n, use_cache=True) -> list[int]`` (HF's own compressor/window
cache, or ``use_cache=False`` for full recompute per token; argmax ties -> lowest id).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

__all__ = ["HFV4"]


def _stable_topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    order = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))


@contextlib.contextmanager
def _stable_ties():
    original = torch.Tensor.topk
    torch.Tensor.topk = _stable_topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


def _have_accelerate() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


def _hf_dequantised_copy(src: Path, dst: Path) -> None:
    """Write a dequantised copy of checkpoint ``src`` to ``dst`` with HF's own dequantiser.

    Every ``<linear>.weight`` that has a ``<linear>.scale`` sibling (FP8 block or MXFP4
    expert) goes through ``transformers``' ``Fp8Dequantize._dequantize_one`` (the op HF's
    FP8 quantizer runs on load); other tensors are copied; ``mtp.*`` is dropped (HF ignores
    it); ``config.json`` loses ``quantization_config``.  Names stay DeepSeek-native, so
    HF's conversion mapping still does all renaming/merging.
    """
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    deq = Fp8Dequantize(None)  # the op does not use its quantizer for dequantisation
    dst.mkdir(parents=True, exist_ok=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    names = set(index)
    new_map: dict[str, str] = {}
    total = 0
    for shard in sorted(set(index.values())):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(src / shard), framework="pt") as f:
            for name in f.keys():
                if name.startswith("mtp."):
                    continue
                base = name[: -len(".weight")] if name.endswith(".weight") else None
                if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in names:
                    continue
                t = f.get_tensor(name)
                if base is not None and base + ".scale" in names:
                    shard_of_scale = index[base + ".scale"]
                    with safe_open(str(src / shard_of_scale), framework="pt") as g:
                        scale = g.get_tensor(base + ".scale")
                    t = deq._dequantize_one(t, scale, output_dtype=torch.float32)
                out[name] = t.contiguous()
                total += t.numel() * t.element_size()
        save_file(out, str(dst / shard), metadata={"format": "pt"})
        new_map.update({k: shard for k in out})
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": new_map}))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)


class HFV4:
    def __init__(self, ckpt_dir: str | Path, dtype: torch.dtype = torch.float32, index_topk: int | None = None,
                 use_hf_quantizer: bool | None = None):
        """``use_hf_quantizer``: None = HF's FP8 quantizer (dequantize=True) when the
        ``accelerate`` package is installed, else the pre-dequantised copy; True/False force."""
        import tempfile

        from transformers import (
            DeepseekV4Config,
            DeepseekV4ForCausalLM,
            FineGrainedFP8Config,
        )

        self.dir = Path(ckpt_dir)
        self.dtype = dtype
        if use_hf_quantizer is None:
            use_hf_quantizer = _have_accelerate()
        elif use_hf_quantizer and not _have_accelerate():
            raise ImportError("use_hf_quantizer=True needs the 'accelerate' package")
        self.load_path = "hf-quantizer" if use_hf_quantizer else "hf-dequantised-copy"
        tmp = None
        load_dir = self.dir
        config = DeepseekV4Config.from_pretrained(str(self.dir))
        qc = getattr(config, "quantization_config", None) or {}
        if not isinstance(qc, dict):
            qc = qc.to_dict()
        quant = None
        if qc.get("quant_method") == "fp8":
            if use_hf_quantizer:
                quant = FineGrainedFP8Config(
                    dequantize=True,
                    weight_block_size=tuple(qc.get("weight_block_size", (128, 128))),
                    scale_fmt=qc.get("scale_fmt", "ue8m0"),
                    activation_scheme=qc.get("activation_scheme", "dynamic"),
                )
            else:
                tmp = tempfile.TemporaryDirectory(prefix="hf_v4_deq_")
                load_dir = Path(tmp.name)
                _hf_dequantised_copy(self.dir, load_dir)
                config = DeepseekV4Config.from_pretrained(str(load_dir))
        if index_topk is not None:
            config.index_topk = int(index_topk)
        kwargs = {"config": config, "dtype": dtype, "output_loading_info": True}
        if quant is not None:
            kwargs["quantization_config"] = quant
        try:
            model, info = DeepseekV4ForCausalLM.from_pretrained(str(load_dir), **kwargs)
        finally:
            if tmp is not None:
                tmp.cleanup()
        bad = {k: list(v) for k, v in info.items() if k != "error_msgs" and v}
        if bad or info.get("error_msgs"):
            raise RuntimeError(f"HF load of {self.dir} is not clean: {bad} {info.get('error_msgs')}")
        model = model.to(dtype).eval()
        self.model = model
        self.config = model.config
        types = list(self.config.layer_types)
        self.layer_types = types
        # Make sure HF's compressors / indexer are really in the graph for compressed layers.
        for l, t in enumerate(types):
            comp = model.model.layers[l].self_attn.compressor
            if t == "sliding_attention":
                assert comp is None, l
            elif t == "compressed_sparse_attention":
                assert comp is not None and hasattr(comp, "indexer"), l
                assert comp.indexer.index_topk == self.config.index_topk, l
            else:
                assert comp is not None and not hasattr(comp, "indexer"), l
        if model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr():
            raise RuntimeError("HF tied lm_head to embed_tokens; the checkpoint has a separate head")

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, V] (float32) of one full-sequence forward without cache."""
        ids = torch.tensor([[int(i) for i in token_ids]], dtype=torch.long)
        with _stable_ties():
            out = self.model(input_ids=ids, use_cache=False)
        return out.logits[0].float()

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], n: int, use_cache: bool = True) -> list[int]:
        """n greedily generated ids (no EOS stop).  ``use_cache`` uses HF's DynamicCache
        (window + compressor state + compressed rows); otherwise each token recomputes
        the full sequence."""
        seq = [int(i) for i in prompt_ids]
        out: list[int] = []
        if n <= 0:
            return out
        if not use_cache:
            for _ in range(n):
                nxt = int(torch.argmax(self.logits(seq)[-1]))
                out.append(nxt)
                seq.append(nxt)
            return out
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        ids = torch.tensor([seq], dtype=torch.long)
        pos = 0
        for _ in range(n):
            T = ids.shape[1]
            position_ids = torch.arange(pos, pos + T).unsqueeze(0)
            with _stable_ties():
                res = self.model(input_ids=ids, position_ids=position_ids, past_key_values=cache, use_cache=True)
            cache = res.past_key_values
            nxt = int(torch.argmax(res.logits[0, -1].float()))
            out.append(nxt)
            pos += T
            ids = torch.tensor([[nxt]], dtype=torch.long)
        return out
