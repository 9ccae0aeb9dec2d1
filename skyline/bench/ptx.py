"""Reading the PTX that Triton generates for an NVIDIA target, without a GPU (Triton compiles
for a target it is told): what bench/kernels/*_ptx_count.py count in a kernel's inner loop."""

from __future__ import annotations

import re
from typing import Any


def compile_for_sm90(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any],
                     divisible: list[str], num_warps: int, num_stages: int) -> Any:
    """`kernel` (a @triton.jit function) compiled for sm_90 with its arguments typed by
    `signature` ("*bf16", "i32", ...; constexprs by `constexprs`) and the arguments that
    `divisible` names marked divisible by 16, as the JIT assumes of real launches."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not hasattr(kernel, "cache_key"):
        raise SystemExit("Triton's interpreter compiles nothing: unset TRITON_INTERPRET")
    names = list(kernel.arg_names)  # in the kernel's order: constexprs are addressed by index
    missing = set(names) - set(signature) - set(constexprs)
    assert not missing, f"the kernel has arguments the caller does not set: {missing}"
    sig = {n: "constexpr" if n in constexprs else signature[n] for n in names}
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def inner_loop(ptx: str) -> list[str]:
    """The instructions of a kernel's first loop (a single-block loop, as Triton's pipelined
    K loops are), from its header to the branch back to it."""
    lines = ptx.splitlines()
    start = next(i for i, line in enumerate(lines) if "Inner Loop Header" in line)
    # the header's label: on the comment's line, or on the line above it (LLVM writes a
    # named block's label, e.g. "%.lr.ph", then the comment on a line of its own)
    while not re.match(r"\$L\w+:", lines[start]):
        start -= 1
    label = lines[start].split(":")[0]
    back = re.compile(rf"bra\S*\s+{re.escape(label)};")
    end = next(i for i in range(start + 1, len(lines)) if back.search(lines[i]))
    body = (line.strip() for line in lines[start + 1 : end + 1])
    return [line for line in body if line and not line.startswith((".", "//", "{", "}", "$"))]


def opcode(instruction: str) -> str:
    parts = instruction.split()
    return parts[1] if parts[0].startswith("@") else parts[0]
