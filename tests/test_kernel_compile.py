"""Triton kernels compile for the H200 (sm_90) on a machine without a GPU.

The interpreter tests (`TRITON_INTERPRET=1 pytest tests/gpu`) check the kernels' numbers but not that the compiler
accepts them (the interpreter is laxer about types); Triton's NVIDIA backend, bundled with the wheel, compiles to a
cubin here. Covered: the kernels added without a GPU run behind them (paged slots, the mHC finalize with a
non-power-of-two partial width and the partial products' two tile sets, the radix-select top-k, the clamped SwiGLU,
RoPE in place, the MoE router), every constexpr variant
the wrappers launch.
"""

from __future__ import annotations

import itertools

import pytest

triton = pytest.importorskip("triton")

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - an older Triton without this API
    pytest.skip("Triton without ASTSource / GPUTarget", allow_module_level=True)

SM90 = GPUTarget("cuda", 90, 32)
SM90_SHARED_BYTES = 232_448  # opt-in shared memory per block on the H100 / H200


def _compile(fn, signature: dict, constexprs: dict, num_warps: int = 4, aligned: tuple[str, ...] = (), **options):
    """Compile for sm_90; `aligned` names the arguments a launch would see 16-divisible (pointers of fresh
    tensors, strides), which is what lets the pipeliner issue async copies (and spend shared memory)."""
    sig = dict(signature, **dict.fromkeys(constexprs, "constexpr"))
    attrs = {(list(sig).index(n),): [["tt.divisibility", 16]] for n in aligned}
    try:
        out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=SM90,
                             options={"num_warps": num_warps, **options})
    except RuntimeError as e:  # no NVIDIA backend / ptxas in this Triton build
        if "backend" in str(e).lower() or "ptxas" in str(e).lower():
            pytest.skip(f"no NVIDIA backend: {e}")
        raise
    assert "cubin" in out.asm
    return out


def test_paged_slots_kernel_compiles():
    from kernels_nvidia import paging

    sig = {"BT": "*i32", "s_bt": "i32", "n_cols": "i32", "REQ": "*i64", "IDS": "*i64", "s_ids": "i32",
           "START": "*i64", "STOP": "*i64", "KEEP": "*i8", "OUT": "*i64", "K": "i32", "TPR": "i32", "BS": "i32",
           "RPB": "i32"}
    for explicit, masked, stop, keep in itertools.product((True, False), repeat=4):
        if not explicit and (not masked or keep):  # range_slots: always masked, never with keep
            continue
        if explicit and stop:  # row_slots has no upper bound
            continue
        _compile(paging._row_slots_kernel, sig, dict(EXPLICIT=explicit, MASKED=masked, HAS_STOP=stop,
                                                     HAS_KEEP=keep, BLOCK=128))


@pytest.mark.parametrize("mp", [24, 32])
def test_hc_finalize_compiles(mp):
    from kernels_nvidia import mhc

    sig = {"PART": "*fp32", "SQ": "*fp32", "BASE": "*fp32", "SCALE": "*fp32", "PRE": "*fp32", "POST": "*fp32",
           "COMB": "*fp32", "T": "i32", "K": "i32", "rms_eps": "fp32", "hc_eps": "fp32", "iters": "i32"}
    _compile(mhc._hc_finalize_kernel, sig, dict(NSPLIT=5, HC=4, MP=mp, BT=16))


def test_hc_partial_kernel_compiles():
    """The mHC coefficient partial products at both tile sets the wrapper launches (decode and prefill)."""
    from kernels_nvidia import mhc

    sig = {"X": "*bf16", "FN": "*fp32", "PART": "*fp32", "SQ": "*fp32", "T": "i32", "K": "i32", "M": "i32",
           "sx_t": "i32", "sfn_m": "i32"}
    for bt, kchunk, stages in ((16, mhc.KCHUNK, 2), (mhc.WIDE_BT, mhc.WIDE_KCHUNK, 3)):
        out = _compile(mhc._hc_mu_partial_kernel, sig, dict(KCHUNK=kchunk, BT=bt, BK=64, MP=32), num_stages=stages,
                       aligned=("X", "FN", "PART", "SQ", "sx_t", "sfn_m"))
        assert out.metadata.shared <= SM90_SHARED_BYTES


@pytest.mark.parametrize("image", [False, True])
def test_engram_hash_kernel_compiles(image):
    """The Engram n-gram hash at V4.1's shape (4-grams, 8 heads) and a non-power-of-two head count."""
    from kernels_nvidia import engram

    sig = {"HIST": "*i64", "VALID": "*u8", "TMAP": "*i64", "MULT": "*i64", "PRIMES": "*i64", "OFFS": "*i64",
           "OUT": "*i64", "N": "i32", "V": "i32", "s_h": "i32", "s_v": "i32", "pad": "i32", "lo": "i32", "hi": "i32"}
    for nh in (8, 3):
        _compile(engram._engram_hash_kernel, sig, dict(K=4, NH=nh, HP=triton.next_power_of_2(nh), IMAGE=image, BN=64),
                 num_warps=2)


@pytest.mark.parametrize("gather", [False, True])
def test_fp8_rows_kernel_compiles(gather):
    """Engram table rows (256 wide, 16 rows a program), gathered by id or all in order."""
    from kernels_nvidia import engram

    sig = {"W": "*u8", "S": "*u8", "ROWS": "*i64", "OUT": "*fp32", "N": "i32", "sw": "i32", "ss": "i32"}
    _compile(engram._fp8_rows_kernel, sig, dict(D=256, G=32, BN=16, GATHER=gather))


@pytest.mark.parametrize("nv", ["*i64", "*i32"])
def test_topk_rows_kernels_compile(nv):
    """The radix-select top-k: the four digit passes, the select and the sort at the k of the indexer
    (candidate blocks, index_topk 512 / 1024 / 2048, MAX_K), n_valid of either int type."""
    from kernels_nvidia import topk

    sig = {"S": "*fp32", "NV": nv, "W": "*i32", "CNT3": "*i32", "n_cols": "i32", "s_row": "i32", "n_split": "i32",
           "k": "i32"}
    for p in range(4):
        _compile(topk._topk_hist_kernel, sig, dict(PASS=p, BLOCK=topk.BLOCK), num_warps=topk.WARPS)
    _compile(topk._topk_select_kernel, dict(sig, OUT="*i64"), dict(BLOCK=topk.BLOCK), num_warps=topk.WARPS)
    for kp in (16, 512, 1024, 2048, topk.MAX_K):
        _compile(topk._topk_sort_kernel, {"NV": nv, "OUT": "*i64", "n_cols": "i32", "k": "i32"}, dict(KP=kp),
                 num_warps=topk.SORT_WARPS)


def test_swiglu_compiles():
    from kernels_nvidia import rowwise

    sig = {"A": "*bf16", "B": "*bf16", "Y": "*bf16", "N": "i32", "sa": "i32", "sb": "i32", "sy": "i32", "limit": "fp32"}
    _compile(rowwise._swiglu_kernel, sig, dict(BLOCK=1024))


def test_rope_kernel_compiles():
    """RoPE, copying (one row a program) and in place (16 rows a program, no copy loop), and its cos / sin tables."""
    from kernels_nvidia import rowwise

    sig = {"X": "*bf16", "C": "*fp32", "S": "*fp32", "Y": "*bf16", "M": "i32", "NOPE": "i32", "sx_t": "i32",
           "sx_m": "i32", "sc_t": "i32", "sy_t": "i32", "sy_m": "i32"}
    for copy, bm in ((True, 1), (False, 16)):
        _compile(rowwise._rope_kernel, sig, dict(SIGN=-1.0, BLOCK_N=256, HALF=32, BM=bm, COPY=copy), num_warps=2)
    out = _compile(rowwise._rope_cos_sin_kernel, {"P": "*i64", "F": "*fp64", "C": "*fp32", "S": "*fp32", "N": "i32",
                                                  "scale": "i32"}, dict(HALF=32, BN=16), num_warps=2,
                   enable_fp_fusion=False)
    ptx = out.asm["ptx"]  # the CUDA math library's fp64 cos / sin (as torch's), no fast approximations
    assert "trig_reduction" in ptx and "sin.approx" not in ptx and "cos.approx" not in ptx


@pytest.mark.parametrize("e,k", [(384, 6), (8, 2), (16, 6), (512, 8), (256, 1)])
def test_router_kernel_compiles(e, k):
    """The MoE router at the release shape (E=384, K=6), the tiny configs (E=8, K=2) and test shapes: shared,
    per-token and no bias, V4.1's bias_vl chosen by token id (int32 ids written), forced ids of either int type,
    with the wrapper's launch options. The libdevice variant must not flush denormals (enable_reflect_ftz off) and
    must use IEEE sqrt / division."""
    from kernels_nvidia import router

    block = max(16, triton.next_power_of_2(e))
    sig = {"L": "*fp32", "B": "*fp32", "BVL": "*fp32", "TOK": "*i64", "F": "*i64", "IDS": "*i64", "W": "*fp32",
           "E": "i32", "s_l": "i32", "s_b": "i32", "s_f": "i32", "scale": "fp32", "lo": "i32", "hi": "i32"}
    opts = dict(enable_reflect_ftz=False, enable_fp_fusion=False)
    base = dict(K=k, KP=max(2, triton.next_power_of_2(k)), BLOCK=block, EXACT=True, VL=False)
    variants = ((True, False, False, "*i64", "*i64"), (True, True, False, "*i64", "*i32"),
                (False, False, False, "*i64", "*i64"), (False, False, True, "*i64", "*i32"),
                (False, False, True, "*i32", "*i64"))
    for has_bias, vl, forced, f_ty, ids_ty in variants:
        out = _compile(router._route_kernel, dict(sig, F=f_ty, IDS=ids_ty),
                       dict(base, HAS_BIAS=has_bias, VL=vl, FORCED=forced), num_warps=router._warps(block, 1), **opts)
        ptx = out.asm["ptx"]
        assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx and "sqrt.approx" not in ptx
    _compile(router._route_kernel, sig, dict(base, HAS_BIAS=True, FORCED=False), num_warps=router._warps(block, 4096),
             **opts)  # prefill: fewer warps
    _compile(router._route_kernel, sig, dict(base, HAS_BIAS=True, FORCED=False, EXACT=False),
             num_warps=router._warps(block, 1), **opts)  # the interpreter's formula (compiles too)


@pytest.mark.parametrize("mute", [False, True])
def test_engram_inject_compiles(mute):
    from kernels_nvidia import engram

    sig = {"X": "*bf16", "K": "*bf16", "V": "*bf16", "QW": "*fp32", "KW": "*fp32", "M": "*u8", "Y": "*bf16",
           "D": "i32", "sx_t": "i32", "sx_h": "i32", "sk_t": "i32", "sk_h": "i32", "sv_t": "i32", "sy_t": "i32",
           "sy_h": "i32", "eps": "fp32", "sqrt_d": "fp32"}
    _compile(engram._engram_inject_kernel, sig, dict(HAS_MUTE=mute, BLOCK=engram.CHUNK))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kv_record_kernels_compile(dtype):
    """The fp8_ds_mla record kernels (E4M3 casts, bf16 pointer views of the byte pages) and the attention kernel's
    record path, split and unsplit, with the wrappers' tiles and pipeline depth, within SM90's shared memory (a
    record load 512 elements wide for the scales and RoPE once needed 246,272 B and failed on the H100)."""
    from kernels_nvidia import attention, kv_records

    _compile(kv_records._store_kernel, {"ROWS": f"*{dtype}", "s_rows": "i32", "SLOTS": "*i64", "PAGES": "*u8",
                                        "P": "i32", "RPB": "i32"}, {})
    _compile(kv_records._gather_kernel, {"PAGES": "*u8", "P": "i32", "RPB": "i32", "SLOTS": "*i64",
                                         "OUT": f"*{dtype}", "N": "i32"}, dict(BN=8))
    sig = {"Q": f"*{dtype}", "KV": "*u8", "IDX": "*i32", "KV2": "*u8", "IDX2": "*i32", "SINK": "*fp32",
           "O": f"*{dtype}", "PO": "*fp32", "PML": "*fp32", "KSEL": "i32", "KSEL2": "i32", "H": "i32", "scale": "fp32",
           "sq_t": "i32", "sq_h": "i32", "skv_n": "i32", "si_t": "i32", "skv2_n": "i32", "si2_t": "i32",
           "so_t": "i32", "so_h": "i32", "NSPLIT": "i32", "RPB": "i32"}
    ieee = dtype == "fp32"
    aligned = ("Q", "KV", "IDX", "KV2", "IDX2", "SINK", "O", "PO", "PML", "sq_t", "sq_h", "skv_n", "si_t", "skv2_n",
               "si2_t", "so_t", "so_h")
    for bh, bn, warps, split in ((32, 16, 8, False) if ieee else (64, 64, 8, False), (16, 64, 4, True)):
        out = _compile(attention._sparse_attn_indexed_kernel, sig,
                       dict(D=512, BH=bh, BN=bn, SPLIT=128 if split else 640, PARTIAL=split, IEEE=ieee, RECORDS=True),
                       num_warps=warps, aligned=aligned, num_stages=attention.STAGES)
        assert out.metadata.shared <= SM90_SHARED_BYTES, (split, out.metadata.shared)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_moe_kernels_compile(dtype):
    """The MXFP4 routed experts of batch-invariant mode (bf16 dots; fp32 IEEE dots) at the release expert count
    and the wrapper's tiles (every row tile) and stages, within SM90's shared memory."""
    from kernels_nvidia import moe

    common = {"order_ptr": "*i32", "ends_ptr": "*i32", "tile_ends_ptr": "*i32", "K_TOP": "i32", "D": "i32", "I": "i32"}
    weights = {"w_ptr": "*u8", "s_ptr": "*u8"}
    strides = {"stride_we": "i64", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32"}
    cx = dict(E=384, E_POW2=512, BN=moe.BN, BK=moe.BK, IEEE=dtype == "fp32")
    gate_up = dict({"x_ptr": f"*{dtype}"}, **weights, h_ptr=f"*{dtype}", **common, limit="fp32", stride_x="i32",
                   **strides)
    down = dict({"h_ptr": f"*{dtype}"}, **weights, y_ptr=f"*{dtype}", **common, **strides)
    for bm in sorted({bm for _, bm in moe.ROW_TILES} | {moe.BM_LARGE}):
        for fn, sig in ((moe._gate_up_kernel, gate_up), (moe._down_kernel, down)):
            aligned = tuple(n for n in sig if n.endswith("_ptr") or n.startswith("stride") or n in ("D", "I"))
            out = _compile(fn, sig, dict(cx, BM=bm), num_warps=moe.WARPS, aligned=aligned, num_stages=moe.stages(bm))
            assert out.metadata.shared <= SM90_SHARED_BYTES, (fn.__name__, bm, out.metadata.shared)
    _compile(moe._combine_kernel, {"y_ptr": f"*{dtype}", "pos_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": f"*{dtype}",
                                   "K_TOP": "i32", "D": "i32"}, dict(BD=moe.BD_COMBINE), num_warps=moe.WARPS)
    pairs = {"ids_ptr": "*i32", "w_ptr": "*fp32", "ws_ptr": "*fp32", "e_ptr": "*i32", "order_ptr": "*i32",
             "ends_ptr": "*i32", "tile_ends_ptr": "*i32", "pos_ptr": "*i64", "P": "i32", "E": "i32", "bm": "i32"}
    _compile(moe._pairs_kernel, pairs, dict(K=6, K_POW2=8, P_POW2=512, E_POW2=512, CHUNK=16), num_warps=moe.WARPS)


@pytest.mark.parametrize("block", [32, 128])
def test_fp8_gemm_kernels_compile(block):
    """The FP8 block GEMM (direct kernel and its swapped form at every token tile, whole and split-K partial; the
    dequantise-to-bf16 kernel) with the
    wrapper's tiles and stages, at V4.1's 32 x 32 and V4's 128 x 128 scale blocks, within SM90's shared memory."""
    from kernels_nvidia import gemm

    sig = {"X": "*bf16", "W": "*fp8e4nv", "S": "*u8", "Y": "*bf16", "M": "i32", "N": "i32", "K": "i32", "sx_m": "i32",
           "sy_m": "i32", "sy_s": "i32", "s_sn": "i32", "n_group": "i32", "k_split": "i32"}
    aligned = ("X", "W", "S", "Y", "N", "K", "sx_m", "sy_m", "sy_s", "n_group", "k_split")
    swap_tiles = sorted({tile for _, tile in gemm.SWAP_TOKEN_TILES} | {gemm.SWAP_TOKEN_TILE_LARGE})
    tiles = [(False, gemm.TILE_M)] + [(True, t) for t in swap_tiles]
    for (swap, tile_m), partial in itertools.product(tiles, (False, True)):
        out = _compile(gemm._fp8_gemm_kernel, dict(sig, Y="*fp32" if partial else "*bf16"),
                       dict(BN=block, BK=block, BLOCK_M=tile_m, BLOCK_N=gemm.TILE_N, BLOCK_K=gemm.TILE_K,
                            PARTIAL=partial, DOT_F32=False, SWAP=swap),
                       num_warps=gemm.WARPS, aligned=aligned, num_stages=gemm.STAGES)
        assert out.metadata.shared <= SM90_SHARED_BYTES, (swap, tile_m, partial, out.metadata.shared)
    _compile(gemm._dequant_kernel, {"W": "*fp8e4nv", "S": "*u8", "OUT": "*bf16", "N": "i32", "K": "i32", "s_sn": "i32"},
             dict(BN=block, BK=block, BLOCK_N=32, BLOCK_K=128))


def test_fp32_out_gemm_kernel_compile():
    """Batch-invariant mode's bf16 GEMM with fp32 output (router, compressor) with the wrapper's tiles and stages,
    within SM90's shared memory."""
    from kernels_nvidia import gemm

    sig = {"X": "*bf16", "W": "*bf16", "Y": "*fp32", "M": "i32", "N": "i32", "K": "i32", "sx_m": "i32", "sw_n": "i32",
           "k_split": "i32"}
    out = _compile(gemm._gemm_fp32_out_kernel, sig,
                   dict(BLOCK_M=gemm.TILE_M, BLOCK_N=gemm.TILE_N, BLOCK_K=gemm.FP32_OUT_TILE_K, DOT_F32=False),
                   num_warps=gemm.WARPS, aligned=("X", "W", "Y", "N", "K", "sx_m", "sw_n", "k_split"),
                   num_stages=gemm.STAGES)
    assert out.metadata.shared <= SM90_SHARED_BYTES, out.metadata.shared
