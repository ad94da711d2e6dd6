r"""DeepInfer's `DEEPINFER_*` environment settings under vLLM: honoured, mapped, or rejected.

Checked by `vllm_deepinfer.serving.register()` (the general plugin) in every vLLM process, so a
setting the plugin cannot honour stops `vllm serve` / `LLM()` at start-up with the reason, instead of
being silently ignored. A setting given its "off" value (`0`, `false`, `no`, `off`, `none`, empty) is
always accepted: it asks for what the plugin does anyway.

| setting | here |
|---|---|
| `DEEPINFER_HF_MODEL_DIR` | mapped: the model path. `vllm serve` with no model argument serves it; `default_model()` gives it to offline code; must be a directory with `config.json`. An explicit model argument wins (warning when they differ). |
| `DEEPINFER_ACCELERATOR` | honoured as a check: `cuda`/`nvidia`/`gpu`, `ascend`/`npu`, `cpu` must match vLLM's platform, else start-up fails naming both. vLLM picks the platform itself. |
| `DEEPINFER_NUMERICS` | honoured: `exact` (default) or `parity` (simulate vLLM in-tree SM90 FP8 KV records, FP8 index q/k and V4 FP8 linear activations; or a comma-separated subset `kv,index_k,index_q,act`); read once at model construction (`vllm_deepinfer/ops/quant.py`). An unknown value stops start-up. |
| `DEEPINFER_FP8_LINEARS` | honoured: `packed` keeps the FP8 block linears' E4M3 codes + E8M0 scale bytes (half the weight memory): on CUDA with bf16/fp16 activations repacked for vLLM's Marlin W8A16 GEMM (`ops.marlin`, what vLLM's in-tree V4.1 runs on SM90) except the thin matrices (wq_a\|wkv, indexer wq_b: our Triton GEMM is faster there), otherwise the weight-only FP8 GEMM `ops.linear_fp8_block` (on CPU the torch reference op); `bf16` dequantises them at load; `auto` (default) = packed on CUDA, bf16 elsewhere (`vllm_deepinfer.ops.parse_storage`). Read at model construction. An unknown value stops start-up. |
| `DEEPINFER_EXPERT_STORAGE` | honoured: the routed experts are vLLM's fused-MoE layer; `packed` keeps their MXFP4 codes + E8M0 scales (a quarter of the expert memory): on CUDA vLLM's MXFP4 method (`Mxfp4MoEMethod`, Marlin W4A16 on SM90), off CUDA the plugin's torch experts on the stored bytes (`ops.routed_experts_packed`, for tests); `bf16` dequantises at load (CUDA: vLLM's unquantized method; off CUDA: `ops.routed_experts`); `auto` (default) = packed on CUDA, bf16 elsewhere (`vllm_deepinfer.moe.method.expert_storage`). Read at model construction. An unknown value stops start-up. |
| `DEEPINFER_ENGRAM_DEVICE` | honoured: where the V4.1 Engram tables live. `host` keeps them in pinned host memory and gathers each step's rows into device staging buffers on a side stream at step start (UVA reads, overlapped with the layers before the Engram layer; CUDA-graph safe); `gpu` keeps them in device memory; `auto` (default) = `host` on CUDA, `gpu` elsewhere (`vllm_deepinfer.ops.parse_engram_device`). Read at model construction; the load logs the bytes on host and device. An unknown value stops start-up. |
| `DEEPINFER_ENGRAM_SHARED` | honoured: `auto`/`1` (default) makes host Engram tables one copy per node in shared memory (`/dev/shm`, unlinked once mapped) that every rank of a TP x DP deployment on the node maps and the node's first rank loads (`vllm_deepinfer/models/shared_host.py`; vLLM's `--engram-config` `dp_shared_memory: false` keeps private DP copies); `0` gives every rank a private copy. One process has nothing to share. An unknown value stops start-up. |
| `DEEPINFER_BATCH_INVARIANT` | honoured: `1` turns on batch-invariant mode (the vLLM-style option is `--additional-config '{"deepinfer_batch_invariant": true}'`, which wins over the variable): ops run their batch-invariant variants and the sampler draws seeded tokens with noise keyed by (seed, position) (`vllm_deepinfer/serving/seeded_sampling.py`). Read at model construction. vLLM's `VLLM_BATCH_INVARIANT=1` is not an equivalent (different kernels/sampler, crashes on CPU) and is never substituted. |
| `DEEPINFER_ENABLE_MTP_VARLEN` | honoured: `1` = confidence-scheduled verification, each request's drafts trimmed to the length that maximises the expected tokens per step time (`vllm_deepinfer/spec_decode/schedule.py`); `0` (default) = every draft verified. With `VLLM_DEEPINFER_DSPARK_V2=1` (DSpark under vLLM's V2 runner, CUDA with full CUDA graphs) `1` becomes vLLM's own adaptive verification, `enable_adaptive_verification` in the speculative config (the same policy; `patches/speculative_settings.py`). Read by the drafter at construction; needs speculation on (`--speculative-config`, or `DEEPINFER_USE_NEXTN_DECODE`; with neither, `1` turns on DeepInfer's default of 5 draft tokens). |
| `DEEPINFER_USE_NEXTN_DECODE` | mapped: `N` >= 1 = `--speculative-config '{"method": "dspark" on V4.1 / "mtp" on V4, "num_speculative_tokens": N}'` for `vllm serve` and `LLM()` when no speculative config is given (a given one wins, with a warning; `patches/speculative_settings.py`). |
| `DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE` | mapped: `compact` turns V4.1 decoder bounded replay on, `none` off (`vllm_deepinfer/models/replay.py`); unset, vLLM's `--swa-bounded-replay` / `--no-swa-bounded-replay` decides (vLLM's default: on). V4 has nothing to replay (ignored with a warning). |
| `DEEPINFER_YOCO_PREFILL_KEEP_TOKENS` | honoured: trailing prompt tokens per request that run the layers past the cut. Unset or `exact` = n(W-1)+1, which is exact; a smaller value (DeepInfer's default 140, vLLM in-tree's 128) is approximate; below the sliding window the model refuses to start. |
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from vllm_deepinfer.log import get_logger

logger = get_logger(__name__)

OFF_VALUES = {"", "0", "false", "no", "off", "none", "disabled"}

ACCELERATORS = {
    "cuda": "cuda", "nvidia": "cuda", "gpu": "cuda",
    "ascend": "npu", "npu": "npu",
    "cpu": "cpu",
}


class DeepInferSettingError(RuntimeError):
    """A DEEPINFER_* setting the plugin cannot honour."""


@dataclass(frozen=True)
class Setting:
    name: str
    action: str  # "mapped" | "check" | "honoured"
    vllm_equivalent: str
    reason: str


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in [
        Setting("DEEPINFER_HF_MODEL_DIR", "mapped", "the model argument (`vllm serve DIR`, `LLM(model=DIR)`)",
                "the HF-format checkpoint directory to serve"),
        Setting("DEEPINFER_ACCELERATOR", "check", "vLLM platform detection (current_platform)",
                "vLLM chooses the device itself; the setting is verified against it"),
        Setting("DEEPINFER_NUMERICS", "honoured", "none (vLLM's in-tree models always quantise KV/index/activations)",
                "numerics of the torch model: exact (BF16/fp32 KV and activations, default) or parity "
                "(quantise-dequantise like vLLM's in-tree SM90 path)"),
        Setting("DEEPINFER_FP8_LINEARS", "honoured", "none (vLLM's in-tree models always keep FP8 weights)",
                "storage of the FP8 block linears: auto (= bf16 today, measured faster), packed (E4M3 codes + E8M0 "
                "scales, weight-only FP8 GEMM) or bf16 (dequantised at load)"),
        Setting("DEEPINFER_EXPERT_STORAGE", "honoured", "none (in-tree always runs MXFP4 experts packed)",
                "storage of the routed experts: auto (= packed on CUDA: vLLM's MXFP4 fused-MoE method; bf16 elsewhere), packed (MXFP4 codes) or bf16"),
        Setting("DEEPINFER_ENGRAM_DEVICE", "honoured", "the in-tree Engram's cpu_offload (on by default)",
                "placement of the V4.1 Engram tables: auto (= host on CUDA), host (pinned host memory, rows "
                "prefetched each step) or gpu (device memory)"),
        Setting("DEEPINFER_ENGRAM_SHARED", "honoured", "the in-tree Engram's dp_shared_memory (on by default with DP)",
                "host Engram tables: one node-shared copy for all ranks on a node (auto/1) or one per rank (0)"),
        Setting("DEEPINFER_BATCH_INVARIANT", "honoured",
                "--additional-config '{\"deepinfer_batch_invariant\": true}' (VLLM_BATCH_INVARIANT is not equivalent)",
                "batch-invariant ops and seeded sampling keyed by (seed, position)"),
        Setting("DEEPINFER_ENABLE_MTP_VARLEN", "honoured",
                "\"enable_adaptive_verification\": true in the speculative config (the same policy here)",
                "per-request draft lengths from the drafter's prefix-survival estimates and a verification cost "
                "model (1), or every draft verified (0)"),
        Setting("DEEPINFER_USE_NEXTN_DECODE", "mapped",
                "--speculative-config '{\"method\": \"dspark\" (V4.1) or \"mtp\" (V4), \"num_speculative_tokens\": N}'",
                "speculative decoding with the checkpoint's drafter, N draft tokens per step (DeepInfer's default 5)"),
        Setting("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "mapped", "--swa-bounded-replay / --no-swa-bounded-replay",
                "V4.1 decoder bounded replay: compact = on, none = off; unset, vLLM's swa_bounded_replay decides"),
        Setting("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "honoured", "none (vLLM in-tree keeps the 128-token window)",
                "trailing prompt tokens that run the layers past the last KV source; default exact n(W-1)+1"),
    ]
}


def _is_off(value: str) -> bool:
    return value.strip().lower() in OFF_VALUES


def check(environ: dict[str, str] | None = None, platform_device: str | None = None) -> list[str]:
    """Validate the DEEPINFER_* settings in `environ`; raise `DeepInferSettingError` on any that
    cannot be honoured. Returns human-readable notes on what was applied."""
    env = os.environ if environ is None else environ
    notes: list[str] = []
    errors: list[str] = []
    for name, s in SETTINGS.items():
        if name not in env:
            continue
        value = env[name]
        if name == "DEEPINFER_HF_MODEL_DIR":
            if _is_off(value):
                continue
            if not os.path.isfile(os.path.join(value, "config.json")):
                errors.append(f"DEEPINFER_HF_MODEL_DIR={value!r} is not a checkpoint directory (no config.json)")
            else:
                notes.append(f"{name}: model path {value}")
        elif name == "DEEPINFER_NUMERICS":
            from vllm_deepinfer.ops.quant import parse_mode

            try:
                parts = parse_mode(value)
            except ValueError as e:
                errors.append(str(e))
            else:
                notes.append(f"{name}: " + ("parity " + ",".join(sorted(parts)) if parts else "exact"))
        elif name in ("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"):
            from vllm_deepinfer.models import replay

            try:
                if name == replay.MODE_ENV:
                    notes.append(f"{name}: bounded replay " + ("on" if replay.parse_mode(value) else "off"))
                else:
                    keep = replay.parse_keep(value)
                    notes.append(f"{name}: keep " + ("exact" if keep is None else f"{keep} tokens"))
            except ValueError as e:
                errors.append(str(e))
        elif name in ("DEEPINFER_FP8_LINEARS", "DEEPINFER_EXPERT_STORAGE"):
            from vllm_deepinfer.ops import parse_storage

            try:
                notes.append(f"{name}: {parse_storage(name, value)}")
            except ValueError as e:
                errors.append(str(e))
        elif name == "DEEPINFER_ENGRAM_DEVICE":
            from vllm_deepinfer.ops import parse_engram_device

            try:
                device = platform_device if platform_device is not None else _platform_device()
                notes.append(f"{name}: {parse_engram_device(value, device or 'cpu')}")
            except ValueError as e:
                errors.append(str(e))
        elif name == "DEEPINFER_ENGRAM_SHARED":
            from vllm_deepinfer.ops import parse_engram_shared

            try:
                notes.append(f"{name}: " + ("one node-shared copy" if parse_engram_shared(value) else "one copy per rank"))
            except ValueError as e:
                errors.append(str(e))
        elif name in ("DEEPINFER_USE_NEXTN_DECODE", "DEEPINFER_ENABLE_MTP_VARLEN"):
            try:
                spec = speculative_config_from_env(env)
            except ValueError as e:
                errors.append(str(e))
            else:
                if name == "DEEPINFER_ENABLE_MTP_VARLEN":
                    notes.append(f"{name}: " + ("off (fixed draft length)" if _is_off(value) else
                                                "confidence-scheduled verification"))
                else:
                    notes.append(f"{name}: " + (f"speculative config {spec}" if spec else "off"))
        elif name == "DEEPINFER_BATCH_INVARIANT":
            notes.append(f"{name}: " + ("off" if _is_off(value) else "batch-invariant mode"))
        elif name == "DEEPINFER_ACCELERATOR":
            if _is_off(value) or value.strip().lower() == "auto":
                continue
            want = ACCELERATORS.get(value.strip().lower())
            if want is None:
                errors.append(f"DEEPINFER_ACCELERATOR={value!r} is unknown; accepted: {sorted(ACCELERATORS)} or auto")
                continue
            have = platform_device if platform_device is not None else _platform_device()
            if have is not None and have != want:
                errors.append(
                    f"DEEPINFER_ACCELERATOR={value!r} asks for {want} but vLLM runs on {have!r}; "
                    f"install the matching vLLM build/platform plugin or unset DEEPINFER_ACCELERATOR"
                )
            else:
                notes.append(f"{name}: {want} (matches vLLM's platform)")
    if errors:
        raise DeepInferSettingError("vllm-deepinfer: " + "; ".join(errors))
    return notes


DEFAULT_NEXTN = 5  # DeepInfer's default number of draft tokens


def draft_method(model: str | None) -> str:
    """vLLM's speculative method of the checkpoint at `model`: "dspark" for V4.1 (its DSpark drafter),
    "mtp" for V4 and anything whose local config.json cannot be read."""
    try:
        with open(os.path.join(model or "", "config.json")) as f:
            model_type = json.load(f).get("model_type", "")
    except (OSError, ValueError):
        return "mtp"
    return "dspark" if model_type in ("deepseek_v41", "deepseek_v41_text") else "mtp"


def speculative_config_from_env(environ: dict[str, str] | None = None, model: str | None = None) -> dict | None:
    """vLLM's speculative config that the DeepInfer settings ask for, None for none:
    DEEPINFER_USE_NEXTN_DECODE=N -> N draft tokens of the checkpoint's drafter (`draft_method(model)`: DSpark
    on V4.1, MTP on V4); DEEPINFER_ENABLE_MTP_VARLEN=1 alone -> N = 5."""
    env = os.environ if environ is None else environ
    nextn = env.get("DEEPINFER_USE_NEXTN_DECODE", "")
    varlen = not _is_off(env.get("DEEPINFER_ENABLE_MTP_VARLEN", ""))
    if _is_off(nextn):
        n = DEFAULT_NEXTN if varlen and not nextn.strip() else 0
    else:
        try:
            n = int(nextn)
        except ValueError:
            n = -1
        if n < 1:
            raise ValueError(f"DEEPINFER_USE_NEXTN_DECODE={nextn!r} must be a positive number of draft tokens (or 0)")
    return {"method": draft_method(model), "num_speculative_tokens": n} if n else None


def _platform_device() -> str | None:
    try:
        from vllm.platforms import current_platform

        dev = getattr(current_platform, "device_type", None) or ""
    except Exception:  # platform not resolvable in this process: nothing to check against
        return None
    return {"cuda": "cuda", "rocm": "cuda", "npu": "npu", "cpu": "cpu"}.get(dev, dev or None)


def default_model(explicit: str | None = None) -> str | None:
    """The model path: `explicit` if given, else `DEEPINFER_HF_MODEL_DIR`."""
    env = os.environ.get("DEEPINFER_HF_MODEL_DIR")
    if explicit:
        if env and not _is_off(env) and os.path.abspath(env) != os.path.abspath(explicit):
            logger.warning("DEEPINFER_HF_MODEL_DIR=%s ignored: the model %s was given explicitly", env, explicit)
        return explicit
    return env if env and not _is_off(env) else None


def _map_model_into_serve_argv(argv: list[str]) -> None:
    """`vllm serve` without a model argument: serve DEEPINFER_HF_MODEL_DIR."""
    env = os.environ.get("DEEPINFER_HF_MODEL_DIR")
    if not env or _is_off(env) or len(argv) < 2 or argv[1] != "serve":
        return
    has_positional = len(argv) > 2 and not argv[2].startswith("-")
    has_flag = any(a == "--model" or a.startswith("--model=") for a in argv[2:])
    if has_positional or has_flag:
        given = argv[2] if has_positional else None
        if given:
            default_model(given)
        return
    argv.insert(2, env)
    logger.info("vllm-deepinfer: serving DEEPINFER_HF_MODEL_DIR=%s", env)


def apply() -> None:
    """Called from the general plugin in every process."""
    for note in check():
        logger.info("vllm-deepinfer setting %s", note)
    _map_model_into_serve_argv(sys.argv)
