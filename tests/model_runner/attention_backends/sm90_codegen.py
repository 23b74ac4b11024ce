"""Compile the Triton attention kernels for an H100 (sm_90) without a GPU, and print the
instructions that matter as JSON: tensor-core products (``mma`` / ``wgmma``), 16-byte async
copies of K/V (``cp.async``), scalar 2-byte loads, local-memory spills.

Run in a process without ``TRITON_INTERPRET`` (the kernels must be decorated for compiling):
``python -m tests.model_runner.attention_backends.sm90_codegen``. Integer arguments get the
divisibility-by-16 hint Triton's launcher gives them when they are (pool strides are).
"""

from __future__ import annotations

import json
import re

from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from model_runner.attention_backends import triton_kernels as tk

RUNTIME = {
    "q_ptr": "*bf16", "kv_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
    "lse_ptr": "*fp32", "qo_indptr": "*i32", "kv_indptr": "*i32", "kv_indices": "*i32",
    "kv_lens": "*i32", "sink_cos": "*fp32", "sink_sin": "*fp32",
}  # fmt: skip
INTS = ("stride_qt", "stride_qh", "stride_kvh", "stride_kvb", "stride_kvo", "stride_ot",
        "stride_oh", "num_heads", "num_kv_heads", "window", "num_sinks")  # fmt: skip
DIVISIBLE = (*RUNTIME, *INTS[:8])
# (name, constexprs): Llama-3-8B's attention (group 4, head_dim 128, pages of 16)
CASES = {
    "decode": {"GROUP_PAD": 16, "BLOCK_Q": 1, "BLOCK_N": 32, "NUM_SPLITS": 1, "DECODE": True},
    "decode_split_sinks": {"GROUP_PAD": 16, "BLOCK_Q": 1, "BLOCK_N": 32, "NUM_SPLITS": 8,
                           "DECODE": True, "HAS_WINDOW": True, "HAS_SINKS": True},
    "prefill": {"GROUP_PAD": 4, "BLOCK_Q": 16, "BLOCK_N": 64, "NUM_SPLITS": 1, "DECODE": False},
}  # fmt: skip


def instruction_counts(ptx: str) -> dict[str, int]:
    found = re.findall(r"\b(wgmma\.mma_async|mma\.sync|cp\.async\.cg|ld\.global\.b16|\.local)", ptx)
    return {k: found.count(k) for k in ("wgmma.mma_async", "mma.sync", "cp.async.cg",
                                         "ld.global.b16", ".local")}  # fmt: skip


def main() -> None:
    fn = tk._attention_kernel
    target = GPUTarget("cuda", 90, 32)
    out = {}
    for name, case in CASES.items():
        consts = {"BLOCK_SIZE": 16, "GROUP": 4, "HEAD_DIM": 128, "HAS_WINDOW": False,
                  "HAS_SINKS": False, "DOT_FP32": False, **case}  # fmt: skip
        types = {**RUNTIME, **dict.fromkeys(INTS, "i32"), **dict.fromkeys(consts, "constexpr")}
        signature = {n: types[n] for n in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE}
        source = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
        kernel = triton_compile(source, target=target, options={"num_warps": 4, "num_stages": 2})
        out[name] = instruction_counts(kernel.asm["ptx"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
