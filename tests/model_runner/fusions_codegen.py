"""Compile the layer fusions (``model_runner.triton_fusions``) for an H100 (sm_90) without a
GPU, at Llama-3-8B's shapes in bf16, and print per kernel the global loads and stores by
width and the local-memory uses as JSON.

Run in a process without ``TRITON_INTERPRET``:
``python -m tests.model_runner.fusions_codegen``. Pointers and row strides get the
divisibility-by-16 hint Triton's launcher gives them when they are.
"""

from __future__ import annotations

import json
import re
from typing import Any

from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from model_runner import triton_fusions as tf

# name: (kernel, runtime argument types, the divisible ones, constexprs, warps)
CASES: dict[str, tuple[Any, dict[str, str], tuple[str, ...], dict[str, Any], int]] = {
    "add_rms_norm": (
        tf._add_rms_norm_kernel,
        {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
         "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "n": "i32", "eps": "fp32"},
        ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "stride_x", "stride_r", "stride_o", "n"),
        {"HAS_ADD": True, "BLOCK": 4096},
        tf._warps(4096),
    ),
    "rope_kv_write": (
        tf._rope_kv_write_kernel,
        {"qkv_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "pos_ptr": "*i64",
         "slot_ptr": "*i64", "kv_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32",
         "stride_cp": "i32", "stride_kvh": "i32", "stride_kvs": "i32",
         "num_heads": "i32", "num_kv_heads": "i32"},
        ("qkv_ptr", "cos_ptr", "sin_ptr", "pos_ptr", "slot_ptr", "kv_ptr", "stride_qt",
         "stride_qh", "stride_cp", "stride_kvh", "stride_kvs"),
        {"stride_ci": 1, "HALF": 64, "HEADS_PAD": 32, "KV_PAD": 8},
        tf.ROPE_WARPS,
    ),
    "silu_mul": (
        tf._silu_mul_kernel,
        {"gu_ptr": "*bf16", "out_ptr": "*bf16", "stride_g": "i32", "stride_o": "i32",
         "inter": "i32"},
        ("gu_ptr", "out_ptr", "stride_g", "stride_o", "inter"),
        {"BLOCK": 2048},
        tf._warps(2048),
    ),
}  # fmt: skip

_OPS = re.compile(r"\b(ld\.global(?:\.\w+)*|st\.global(?:\.\w+)*)\s")


def access_counts(ptx: str) -> dict[str, int]:
    """Global loads / stores by width (``ld.global.v4.b32`` moves 16 bytes), and uses of
    local memory (spills)."""
    counts: dict[str, int] = {}
    for op in _OPS.findall(ptx):
        op = re.sub(r"\.(L1|L2|nc|ca|cg|cs|lu|cv|wb|wt|evict_\w+)", "", op)
        counts[op] = counts.get(op, 0) + 1
    counts[".local"] = len(re.findall(r"\.local\b", ptx))
    return counts


def main() -> None:
    target = GPUTarget("cuda", 90, 32)
    out = {}
    for name, (fn, runtime, divisible, consts, warps) in CASES.items():
        types = {**runtime, **dict.fromkeys(consts, "constexpr")}
        signature = {n: types[n] for n in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
        source = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
        kernel = triton_compile(source, target=target, options={"num_warps": warps})
        out[name] = access_counts(kernel.asm["ptx"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
