"""Whether a compiled kernel's K loop waits for the tensor-core MMA it has just issued, read
from Triton's TTGIR (`compiled.asm["ttgir"]`).

An asynchronous MMA (Hopper's wgmma, Blackwell's tcgen05) overlaps the loop's other work only
while nothing waits for it. Two forms serialize every step, so that a program's step takes its
instruction issue *plus* the MMA, overlapped only with other programs resident on the SM:

- sm_100: `ttng.tc_gen5_mma*` arrives on a barrier that a `ttng.wait_barrier` of the same
  iteration then waits on (the accumulator or a scale buffer reused next step: Triton 3.7 does
  this where a block-scaled MMA's scales reach tensor memory through registers);
- sm_90: `ttng.warp_group_dot_wait {pendings = 0}` after a `ttng.warp_group_dot` of the same
  iteration (no wgmma left in flight across steps).

A pipelined loop waits at the start of a step for an earlier step's MMA (a barrier carried
by the loop, or `pendings` >= 1), which neither form matches.
"""

from __future__ import annotations

import re

# the completion barrier of an asynchronous tcgen05 MMA: `..., %bar[%pred] {is_async}`
_TC5_MMA = re.compile(r"ttng\.tc_gen5_mma\w*\s.*?(%[\w#]+)\[[^\]]*\]\s*\{[^}]*is_async")
_WAIT = re.compile(r"ttng\.wait_barrier\s+(%[\w#]+)\s*,")
_WGMMA = re.compile(r"ttng\.warp_group_dot\s")
_WGMMA_WAIT_ALL = re.compile(r"ttng\.warp_group_dot_wait\b.*pendings\s*=\s*0\b")
# an iteration's end or another loop's start: barriers and wgmmas of before no longer count
_BOUNDARY = re.compile(r"\bscf\.(yield|for)\b")


def waits_own_mma(ttgir: str) -> bool:
    """True when some loop iteration waits for the MMA it issued (module docstring)."""
    barriers: set[str] = set()
    wgmma = False
    for line in ttgir.splitlines():
        if _BOUNDARY.search(line):
            barriers.clear()
            wgmma = False
            continue
        mma = _TC5_MMA.search(line)
        if mma:
            barriers.add(mma.group(1))
            continue
        wait = _WAIT.search(line)
        if wait and wait.group(1) in barriers:
            return True
        if _WGMMA.search(line):
            wgmma = True
        elif wgmma and _WGMMA_WAIT_ALL.search(line):
            return True
    return False


# per SM on sm_80 / sm_90 / sm_100: registers, resident warps; its shared memory is a
# program's most (`aot.SMEM_LIMIT`) plus the 1 KB reserved per program
SM_REGISTERS = 65536
SHARED_RESERVED_PER_PROGRAM = 1024
SM_MAX_WARPS = 64
REGISTER_GRANULE = 8  # registers per thread are allocated in multiples of 8


def programs_per_sm(registers: int, warps: int, shared_bytes: int, target: int) -> int:
    """Programs of a kernel resident on one sm_<target> SM at once (at least 1): by its
    registers per thread, its shared memory and the SM's warp slots."""
    from vllm_mxplus.kernel_tools.aot import SMEM_LIMIT

    regs = -(-max(registers, 1) // REGISTER_GRANULE) * REGISTER_GRANULE
    by_regs = SM_REGISTERS // (regs * 32 * warps)
    sm_shared = SMEM_LIMIT[target] + SHARED_RESERVED_PER_PROGRAM
    by_smem = sm_shared // (shared_bytes + SHARED_RESERVED_PER_PROGRAM)
    return max(1, min(by_regs, by_smem, SM_MAX_WARPS // warps))
