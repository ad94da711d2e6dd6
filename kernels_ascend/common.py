"""Launch and decode helpers shared by the Ascend kernels (see the package docstring for the dialect rules)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels_ascend import interpreting, num_cores

#: Triton's interpreter computes bf16 `tl.dot` wrongly (triton 3.9: errors of 1e10); under it the
#: operands are upcast to fp32 (exact for bf16/fp16), on the NPU the cube unit takes them as they are.
F32DOT = interpreting()


def grid(tasks: int, vector: bool = False) -> tuple[int]:
    """Persistent 1-D grid: one program per AI core (at most; per vector core for kernels without tl.dot),
    each looping over its tasks."""
    return (max(1, min(tasks, num_cores(vector))),)


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@triton.jit
def dot(a, b, F32: tl.constexpr):
    """a @ b with fp32 accumulation (operands upcast when F32)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def e8m0(s):
    """UE8M0 bytes (any int tensor, 0..254) -> fp32 2^(s-127), built from the exponent bits (exact; 0 -> 2^-127)."""
    s = s.to(tl.int32)
    return tl.where(s == 0, 5.877471754111438e-39, (s << 23).to(tl.float32, bitcast=True))


@triton.jit
def e4m3(b):
    """E4M3 (fn) bytes -> fp32 values, exact (0x7F/0xFF -> NaN)."""
    b = b.to(tl.int32) & 255
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    normal = (8.0 + m) * ((e + 117) << 23).to(tl.float32, bitcast=True)  # (1 + m/8) 2^(e-7)
    mag = tl.where(e == 0, m * 0.001953125, normal)                       # subnormal: m 2^-9
    mag = tl.where((b & 127) == 127, float("nan"), mag)
    return tl.where(b >= 128, -mag, mag)


@triton.jit
def e2m1(n):
    """E2M1 nibbles (0..15, bit 3 = sign) -> fp32 values {0, .5, 1, 1.5, 2, 3, 4, 6} with sign, exact."""
    n = n.to(tl.int32)
    e = (n >> 1) & 3
    m = (n & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * ((e + 126) << 23).to(tl.float32, bitcast=True))
    return tl.where((n & 8) != 0, -mag, mag)
