"""The on-chip resolve's build: its compile-time sizes, its shared memory, and NVRTC (no driver needed).

``resolve.cu`` beside this file is compiled once per GPU architecture and :class:`OnChipConfig` (the call's sizes
and modes are compile-time constants, so loops over a row's occurrences and slots are unrolled and bounded) by
NVRTC through ``cuda.bindings.nvrtc`` (pip ``cuda-bindings`` and ``nvidia-cuda-nvrtc``). That works on a machine
without a GPU or driver too: ``scripts/compile_check.py`` builds it for sm_90 and sm_100 on the CPU and reports
registers and spills. Nothing here imports CUDA packages until a compile is asked for.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import NamedTuple

import attrs

from kvplan.counters import HITS, OVERFLOW
from kvplan.workspace import (
    CLEARED,
    CURRENT,
    EMPTIES,
    EPOCH,
    FORMAT,
    HASH,
    HASH_HI,
    HOST_ROW_LIMIT,
    KEY_SHIFT,
    LOW_MASK,
    PADDING,
    STAMP_SHIFT,
    WorkspaceRegions,
    next_pow2,
)

__all__ = ["OnChipConfig", "Build", "compile_resolve", "shared_bytes", "MAX_OCCURRENCES", "MAX_HOT"]

SOURCE = Path(__file__).with_name("resolve.cu")
KERNEL_NAME = "kvplan_resolve"
MAX_OCCURRENCES = 16384  # S*K per row: occurrence entries are int16 and each thread's run fits a 32-bit mask
MAX_HOT = 32767  # LRU positions (int16 ranks)
MAX_THREADS = 1024


@attrs.frozen
class OnChipConfig:
    """What one build of the on-chip resolve is specialised for: a call's sizes, its plan mode and the index dtypes
    (every field a compile-time constant of the kernel)."""

    steps: int
    top_k: int
    hot: int
    tail: int
    speculative: bool
    sorted: bool  # the plan in host-row order (its miss lists through the workspace)
    apart: bool  # (sorted, single-step) the plan in miss order, its host-row order in the workspace
    epochs: bool  # keep the workspace's epoch words (a share launch follows)
    rpi64: bool
    seq64: bool
    has_num_real: bool
    has_counters: bool
    layout: WorkspaceRegions
    block: int = 0  # the block front end (docs/kernels.md §2a): tokens per block id (0: token ids)
    check_newest: bool = False  # (single-step) slot HOT serves the newest token unless it names another token
    dense_tokens: bool = False  # top_k_tokens rows dense: occurrence offsets without the strides' products
    dense_out: bool = False  # top_k_device_locs rows dense
    # (sorted, epochs) each plan entry claims its host row in the call's table as the block writes it (no share launch)
    share: bool = attrs.field(default=False)
    # (a plan in miss order) each block publishes its row to the copy through the row's ready word: the copy starts
    # per row, not when the whole resolve is done
    ready: bool = attrs.field(default=False)

    @share.validator
    def _share_from_a_sorted_plan(self, attribute, value) -> None:
        if value and not (self.sorted and self.epochs):
            raise ValueError("OnChipConfig.share needs a sorted plan with epochs (sorted=True, epochs=True): entries "
                             "claim host rows from the sorted plan, in tables the epochs keep")  # fmt: skip

    @ready.validator
    def _ready_in_miss_order(self, attribute, value) -> None:
        if value and self.sorted:
            raise ValueError("OnChipConfig.ready needs a plan in miss order (sorted=False): a sorted plan is written "
                             "by the launches after the resolve")  # fmt: skip

    @property
    def occurrences(self) -> int:
        return self.steps * self.top_k

    @property
    def threads(self) -> int:
        """Threads per block: enough for the row's occurrences and slots, a multiple of 32, at most 1024."""
        return max(128, min(MAX_THREADS, next_pow2(max(self.occurrences, self.hot))))

    @property
    def table_entries(self) -> int:
        """Shared token-table entries: 1.5x the sort block (at most two thirds full; the sort's keys fit in it)."""
        block = max(32, next_pow2(self.occurrences))
        return block + block // 2

    @property
    def tail_entries(self) -> int:
        return max(32, next_pow2(2 * self.tail))

    @property
    def sort_block(self) -> int:
        """The sort's block: a power of two >= S*K (the share launch reads every miss's sorted place)."""
        return max(32, next_pow2(self.occurrences))

    def fits(self) -> bool:
        """Whether the kernel's limits allow these sizes (occurrence entries and ranks are int16)."""
        return 0 < self.occurrences <= MAX_OCCURRENCES and 0 < self.hot <= MAX_HOT and self.tail >= 0


def shared_bytes(config: OnChipConfig) -> int:
    """Dynamic shared memory one block takes (``resolve.cu``'s ``Shared``, in its order)."""
    warps = config.threads // 32
    words = 3 * config.table_entries + 2 * config.tail_entries + warps + 8 + 2 * config.steps  # (step lengths: int64)
    shorts = config.occurrences + 3 * config.hot
    return 4 * words + 2 * shorts


def prelude(config: OnChipConfig) -> str:
    """The constants ``resolve.cu`` is compiled with."""
    lay = config.layout
    ints = dict(
        THREADS=config.threads, S=config.steps, K=config.top_k, HOT=config.hot, P=config.tail,
        TBS=config.table_entries, TPS=config.tail_entries, SB=config.sort_block,
        LOG_SB=config.sort_block.bit_length() - 1, WS_TABLE=lay.table_size,
        W_CURRENT=CURRENT, W_EPOCH=EPOCH, W_CLEARED=CLEARED, W_FORMAT=FORMAT, W_EMPTIES=EMPTIES, W_SPAN=lay.span,
        W_READY=lay.sync, W_SHARED_FROM=lay.shared_from, W_MISS_RANK=lay.miss_rank, HOST_ROW_LIMIT=HOST_ROW_LIMIT,
        HASH_LO=HASH, HASH_HI=HASH_HI, STAMP_SHIFT=STAMP_SHIFT, KEY_SHIFT=KEY_SHIFT, LOW_MASK=LOW_MASK,
        W_PADDING=PADDING, W_KEYS=lay.keys, W_HOT=lay.hot, W_OCC_ENTRY=lay.occ_entry, W_OLD_LRU=lay.old_lru,
        W_MISS_LOC=lay.miss_loc, W_MISS_HOST=lay.miss_host, SIGNATURE=lay.signature, C_HITS=HITS, C_OVERFLOW=OVERFLOW,
        BS=config.block,
    )  # fmt: skip
    flags = dict(
        SPEC=config.speculative, SORTED=config.sorted, APART=config.apart, EPOCHS=config.epochs, RPI64=config.rpi64,
        SEQ64=config.seq64, HAS_NUM_REAL=config.has_num_real, HAS_COUNTERS=config.has_counters,
        CHECK_NEWEST=config.check_newest, TOK_DENSE=config.dense_tokens, OUT_DENSE=config.dense_out,
        READY=config.ready, SHARE=config.share,
    )  # fmt: skip
    lines = [f"constexpr int {k} = {v};" for k, v in ints.items()]
    lines += [f"constexpr bool {k} = {'true' if v else 'false'};" for k, v in flags.items()]
    return "\n".join(lines) + "\n"


class Build(NamedTuple):
    """One compiled build: the cubin, its architecture, and what ptxas reported."""

    cubin: bytes
    arch: str
    registers: int
    spill_bytes: int
    log: str


class CompileError(RuntimeError):
    """NVRTC refused ``resolve.cu`` (a bug of kvplan's, or an NVRTC too old for the architecture)."""


@functools.lru_cache(maxsize=64)
def compile_resolve(config: OnChipConfig, arch: str) -> Build:
    """``resolve.cu`` compiled for ``arch`` (``"sm_90"``) with ``config``'s constants: a cubin, cached per process."""
    from cuda.bindings import nvrtc

    source = (prelude(config) + SOURCE.read_text()).encode()

    def check(result):
        error, *rest = result
        if error != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC: {nvrtc.nvrtcGetErrorString(error)[1].decode()}")
        return rest[0] if len(rest) == 1 else rest

    program = check(nvrtc.nvrtcCreateProgram(source, b"resolve.cu", 0, [], []))
    options = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"--ptxas-options=-v", b"-lineinfo"]
    try:
        error = nvrtc.nvrtcCompileProgram(program, len(options), options)[0]
        size = check(nvrtc.nvrtcGetProgramLogSize(program))
        log = b" " * size
        check(nvrtc.nvrtcGetProgramLog(program, log))
        log_text = log.decode(errors="replace").rstrip("\x00 \n")
        if error != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"resolve.cu did not compile for {arch}:\n{log_text}")
        size = check(nvrtc.nvrtcGetCUBINSize(program))
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(program, cubin))
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    registers = re.search(r"Used (\d+) registers", log_text)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log_text)]
    return Build(bytes(cubin), arch, int(registers.group(1)) if registers else -1, max(spills, default=0), log_text)
