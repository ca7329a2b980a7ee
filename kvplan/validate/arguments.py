"""Checks of a whole kernel call (swap-in, plan copy, materialize): shapes, dtypes, strides, devices, storage bounds
and memory overlap, nothing else. The kernels, the ``torch.library`` ops, the reference and the pool's launches all
call these.

They never read tensor contents, never synchronise and allocate nothing. Value preconditions (token ranges, LRU
permutations, row indices) are not checked here: the kernels guard every access instead (see
``kvplan.reference.swap_in`` for the defined outcomes). Each error names the argument, what was expected and what was
given; ``TypeError`` for a non-tensor, ``ValueError`` for everything else. The plan and materialize texts are the raw
validators' (:mod:`kvplan.validate.messages`), which run first; the type, dtype, shape, stored-values and one-device
rules of every tensor, and the rules of the hot-buffer tables, are :mod:`kvplan.table_rules`' (``HotBufferState`` runs
the tables' when it is built, with the same texts).

A kernel launch laid out like one that passed (see ``kvplan.runtime.launch_replay.LaunchCache``) is replayed without
running these again: their outcome depends only on that layout (addresses, shapes, strides, dtypes, devices, storage
ends, and the other arguments with their types), all of which is in the layout key.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import attrs
import torch

from kvplan.calls import SwapInCall, check_newest_error
from kvplan.config import as_float
from kvplan.counters import NUM_COUNTERS, check_counter_base
from kvplan.plan import MissPlan
from kvplan.table_rules import (
    TABLE,
    device_key,
    hot_error,
    not_tensor,
    row_stride_error,
    unresolved_view,
    wrong_device,
    wrong_dtype,
    wrong_shape,
)
from kvplan.validate.messages import check_materialize, check_miss_plan, check_spec_miss_plan, plan_dtype_error
from kvplan.workspace import MAX_OCCURRENCES, ROW_WORDS, swap_in_workspace_columns

_INDEX_DTYPES = (torch.int32, torch.int64)


@attrs.frozen(slots=True)
class SwapInDims:
    """Sizes of one swap-in call, read off validated arguments."""

    batch: int  # B
    steps: int  # S (1 for the single-step path)
    top_k: int  # K
    requests: int  # R
    hot: int  # HOT
    width: int  # W = HOT + P
    max_len: int  # Lmax: host_cache_locs columns
    scratch: int  # C: scratch_locs columns (0 without)

    @property
    def occurrences(self) -> int:
        return self.steps * self.top_k

    @property
    def tail(self) -> int:
        return self.width - self.hot


def _expect_tensors(**values: object) -> None:
    for name, value in values.items():
        if error := not_tensor(name, value):
            raise error


def _expect_optional_tensors(**values: object) -> None:
    for name, value in values.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise not_tensor(name, value, optional=True)


def _expect_dtype(name: str, t: torch.Tensor, *dtypes: torch.dtype) -> None:
    if error := wrong_dtype(name, t, *dtypes):
        raise error


def _expect_table_dtype(name: str, t: torch.Tensor) -> None:
    """A hot-buffer table's declared dtype (``kvplan.table_rules.TABLES``)."""
    _expect_dtype(name, t, TABLE[name].dtype)


def _expect_vector(name: str, t: torch.Tensor, length: int) -> None:
    if t.dim() != 1 or t.shape[0] < length:
        raise ValueError(f"{name} must have shape [>= {length}], got {tuple(t.shape)}.")


def check_in_storage(**tensors: object) -> None:
    """Every element each given tensor's shape and strides reach from its storage offset lies inside its storage.

    Nothing else guarantees it: a view outlives ``untyped_storage().resize_(0)`` (the FSDP-style free) or a shrinking
    resize, keeping its shape, and a kernel then reads or writes past the allocation (on a GPU: an illegal address,
    or unrelated live tensors overwritten without an error). Reads sizes only; empty tensors pass, non-tensors
    (``None``, flags) are skipped.
    """
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            continue
        last = t.storage_offset()  # the last element reached, in elements from the storage's start
        for n, stride in zip(t.shape, t.stride()):
            if n == 0:
                break
            last += (n - 1) * stride
        else:
            size = t.element_size()
            held = t.untyped_storage().nbytes()
            if (last + 1) * size > held:
                raise ValueError(
                    f"{name} must lie inside its storage: its shape {tuple(t.shape)}, strides {t.stride()} and storage "
                    f"offset {t.storage_offset()} reach {(last + 1) * size} bytes ({last + 1} elements of {size} B), "
                    f"its storage holds {held} bytes; it was freed or shrunk under the view (untyped_storage()"
                    ".resize_): launch once it holds the tensor again, or pass a view of live memory."
                )


# --------------------------------------------------------------------------------------------------------------------
# Memory layout: what a kernel writes must not overlap itself or another argument. Written through its strides, a view
# whose elements share memory (an ``expand``ed tensor, rows with a row stride below their width) makes several
# programs race on one address; an output sharing memory with another argument corrupts what the kernel reads or
# writes there. Both are refused from shapes, strides and data pointers alone (no tensor contents read).

_SEARCH_LIMIT = 4096  # overlap search nodes before a pair is conservatively reported as sharing memory


def overlaps_itself(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True unless every index of a view with these sizes and element strides provably has its own address.

    Proof used: the dims of size > 1, sorted by stride, each step past everything the smaller ones span. That holds
    for every dense or sliced, padded or permuted layout; exotic interleavings it cannot prove count as overlapping.
    """
    if len(shape) == 1:
        return shape[0] > 1 and strides[0] == 0
    dims = sorted((stride, size) for size, stride in zip(shape, strides) if size > 1)
    span = 0  # elements the smaller dims reach past an index's first element
    for stride, size in dims:
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


# A memory operand: (name, tensor, sizes of the part the kernel touches, its element strides).
_Operand = tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]
# What a kernel touches of an argument: (name, tensor, its first rows, its first columns; None: all of them).
MemorySpec = tuple[str, torch.Tensor, "int | None", "int | None"]


def _share_memory(a: _Operand, b: _Operand, address=torch.Tensor.data_ptr) -> bool:
    """Whether two operands whose address ranges meet have an element in common (conservative: True when the layouts
    are too intricate to decide within ``_SEARCH_LIMIT`` steps, or the dtypes differ in size or alignment)."""
    size = a[1].element_size()
    delta = address(b[1]) - address(a[1])
    if b[1].element_size() != size or delta % size:
        return True
    # common element: sum(i_k * a.stride(k)) - sum(j_k * b.stride(k)) == delta / size with 0 <= i_k < a.shape[k], ...
    terms = [(stride, n) for n, stride in zip(a[2], a[3]) if n > 1 and stride]
    terms += [(-stride, n) for n, stride in zip(b[2], b[3]) if n > 1 and stride]
    terms.sort(key=lambda term: -abs(term[0]))
    low, high = [0] * (len(terms) + 1), [0] * (len(terms) + 1)  # what terms k.. can add, at least / at most
    for k in range(len(terms) - 1, -1, -1):
        coef, n = terms[k]
        low[k] = low[k + 1] + min(0, coef * (n - 1))
        high[k] = high[k + 1] + max(0, coef * (n - 1))
    budget = [_SEARCH_LIMIT]

    def reachable(k: int, target: int) -> bool:
        if not low[k] <= target <= high[k]:
            return False
        if k == len(terms):
            return True  # low == high == 0 here
        budget[0] -= 1
        if budget[0] < 0:
            return True
        coef, n = terms[k]
        lo, hi = target - high[k + 1], target - low[k + 1]  # coef * x must fall in [lo, hi]
        if coef < 0:
            lo, hi = -hi, -lo
        first, last = max(0, -(-lo // abs(coef))), min(n - 1, hi // abs(coef))
        return any(reachable(k + 1, target - coef * x) for x in range(first, last + 1))

    return reachable(0, delta // size)


def _operand(name: str, t: torch.Tensor, rows: int | None = None, cols: int | None = None, hint=int) -> _Operand:
    """The part of ``t`` a kernel touches: its first ``rows`` rows and ``cols`` columns when given (``hint`` turns a
    size into an int: a symbolic one of a traced step by its hint, never adding a guard)."""
    shape = tuple(hint(n) for n in t.shape)
    if rows is not None:
        shape = (min(shape[0], hint(rows)), *shape[1:])
    if cols is not None:
        shape = (shape[0], min(shape[1], hint(cols)), *shape[2:])
    return name, t, shape, tuple(hint(n) for n in t.stride())


def _size_hint(n) -> int:
    """A size of a fake tensor as an int: a symbolic one by its hint (the size of the inputs being traced)."""
    return n if isinstance(n, int) else int(n.node.hint)


def _fake_addresses(operands: list[_Operand]):
    """Addresses for fake tensors (a traced step), which have no data pointers: each storage its own range, far
    apart, and each tensor at its storage offset in it. Tensors sharing a storage share a range, as they do when they
    run."""
    bases: dict[int, int] = {}
    for _, t, _, _ in operands:
        bases.setdefault(id(t.untyped_storage()), (len(bases) + 1) << 52)

    def address(t: torch.Tensor) -> int:
        return bases[id(t.untyped_storage())] + _size_hint(t.storage_offset()) * t.element_size()

    return address


def check_written(written: Sequence[MemorySpec], read: Sequence[MemorySpec], *, fake: bool = False) -> None:
    """Each written operand must not overlap itself or any other operand (written or read). Costs a few
    microseconds: address ranges first, the exact test only for operands whose ranges meet. ``fake``: the tensors
    are a traced step's fake tensors (``kvplan.ops``), compared by storage and storage offset, sizes by their hints."""
    hint = _size_hint if fake else int
    written = [_operand(*spec, hint=hint) for spec in written]
    read = [_operand(*spec, hint=hint) for spec in read]
    address = _fake_addresses(written + read) if fake else torch.Tensor.data_ptr
    for name, _, shape, strides in written:
        if overlaps_itself(shape, strides):
            raise ValueError(
                f"{name} must not have overlapping elements (the kernel writes it): got shape {shape} "
                f"strides {strides}; pass a view of its own memory, not an expanded or stride-aliased one."
            )
    spans = []
    for is_written, group in ((True, written), (False, read)):
        for operand in group:
            _, t, shape, strides = operand
            reach = 0
            for n, stride in zip(shape, strides):
                if n == 0:
                    break
                reach += (n - 1) * stride
            else:
                first, size = address(t), t.element_size()
                spans.append((first, first + reach * size + size - 1, is_written, operand))
    spans.sort(key=lambda span: span[0])
    for i, (_, last, is_written, operand) in enumerate(spans):
        for j in range(i + 1, len(spans)):
            other_first, _, other_written, other = spans[j]
            if other_first > last:
                break
            if (
                (is_written or other_written)
                and operand[1].device == other[1].device
                and _share_memory(operand, other, address)
            ):
                writer, peer = (operand[0], other[0]) if is_written else (other[0], operand[0])
                raise ValueError(
                    f"{writer} must not share memory with {peer} (the kernel writes {writer}); pass separate "
                    "tensors, or views of one that do not overlap."
                )


def swap_in_memory(call: SwapInCall, batch: int, occurrences: int) -> tuple[list[MemorySpec], list[MemorySpec]]:
    """What a swap-in writes and reads (the parts written: plan entries ``[0, S*K)`` and the counts, workspace rows
    of the batch rows; the block front end's V rows beside the K rows), for :func:`check_written`."""
    named = call.flat_blocks_dict()
    written: list[MemorySpec] = [
        (name, named[name], None, None)
        for name in ("top_k_device_locs", "device_buffer_tokens", "lru_slots", "device_buffer")
    ]
    if call.device_buffer_v is not None:
        written.append(("device_buffer_v", call.device_buffer_v, None, None))
    if call.plan is not None:
        written += [
            ("miss_src", call.plan.src, batch, occurrences),
            ("miss_dst", call.plan.dst, batch, occurrences),
            ("miss_count", call.plan.count, batch, None),
        ]
    if call.workspace is not None:
        written.append(("workspace", call.workspace, batch, None))
    if call.counters is not None:
        written.append(("counters", call.counters, None, None))
    tok_name = "top_k_tokens" if call.sparse_block_size is None else "top_k_blocks"
    read: list[MemorySpec] = [(tok_name, call.top_k_tokens, None, None)]
    read_names = ("req_pool_indices", "seq_lens", "device_buffer_locs", "host_cache_locs", "host_cache")
    read += [(name, named[name], None, None) for name in read_names]
    if call.host_cache_v is not None:
        read.append(("host_cache_v", call.host_cache_v, None, None))
    read += [(name, named[name], None, None) for name in ("scratch_locs", "num_real_reqs") if named[name] is not None]
    return written, read


def copy_memory(
    plan: MissPlan,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    num_real_reqs: torch.Tensor | None,
    counters: torch.Tensor | None,
    workspace: torch.Tensor | None,
    host_cache_v: torch.Tensor | None = None,
    device_buffer_v: torch.Tensor | None = None,
) -> tuple[list[MemorySpec], list[MemorySpec]]:
    """What a plan copy writes and reads (with ``host_cache_v``/``device_buffer_v``: the V rows beside the K rows),
    for :func:`check_written`."""
    batch = plan.src.shape[0]
    written: list[MemorySpec] = [("device_buffer", device_buffer, None, None)]
    if device_buffer_v is not None:
        written.append(("device_buffer_v", device_buffer_v, None, None))
    if counters is not None:
        written.append(("counters", counters, None, None))
    read: list[MemorySpec] = [
        ("miss_src", plan.src, None, None),
        ("miss_dst", plan.dst, None, None),
        ("miss_count", plan.count, batch, None),
        ("host_cache", host_cache, None, None),
    ]
    if host_cache_v is not None:
        read.append(("host_cache_v", host_cache_v, None, None))
    if num_real_reqs is not None:
        read.append(("num_real_reqs", num_real_reqs, None, None))
    if workspace is not None:
        read.append(("workspace", workspace, batch, None))
    return written, read


def materialize_memory(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    k_out: torch.Tensor | None,
    v_out: torch.Tensor | None,
) -> tuple[list[MemorySpec], list[MemorySpec]]:
    """What materialize writes (the given outputs; nothing to check without) and reads, for :func:`check_written`."""
    written: list[MemorySpec] = [
        (name, t, None, None) for name, t in (("k_out", k_out), ("v_out", v_out)) if t is not None
    ]
    if not written:
        return [], []
    read: list[MemorySpec] = [
        (name, t, None, None)
        for name, t in (
            ("kv", kv),
            ("k_norm_weight", k_norm_weight),
            ("eps", eps),
            ("cos_sin_cache", cos_sin_cache),
            ("positions", positions),
        )
    ]
    return written, read


def _check_launchable(device: torch.device, name: str) -> None:
    if device.type == "cuda":
        return
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        check_interpreter_set_first(name)
        return
    raise ValueError(
        f"{name} must be on a CUDA device (CPU tensors need TRITON_INTERPRET=1 set before kvplan.kernels "
        f"is imported), got {device}."
    )


def check_interpreter_set_first(name: str) -> None:
    """CPU tensors with ``TRITON_INTERPRET=1`` set only after ``kvplan.kernels`` was imported: Triton read it when it
    decorated the kernels, which were built for a GPU, and would fail deep inside Triton (``0 active drivers``)."""
    kernels = sys.modules.get("kvplan.kernels")
    if kernels is not None and getattr(kernels, "INTERPRETED", True) is False:
        raise ValueError(
            f"{name} is on the CPU and TRITON_INTERPRET=1 is set, but it was set after kvplan.kernels was imported: "
            "Triton reads it when it decorates a kernel, so kvplan's kernels were built for a GPU. Set "
            "TRITON_INTERPRET=1 before kvplan.kernels (or kvplan.ops) is first imported: in the environment, or at the "
            "top of the script before those imports (import kvplan and building a pool import neither)."
        )


def check_num_real_reqs(num_real_reqs: torch.Tensor | None, device: torch.device | None, owner: str) -> None:
    """``None`` or a ``[1]`` int32 tensor on the kernels' device: the kernels read it there, never on the host."""
    if num_real_reqs is None:
        return
    _expect_tensors(num_real_reqs=num_real_reqs)
    _expect_dtype("num_real_reqs", num_real_reqs, torch.int32)
    if num_real_reqs.dim() != 1 or num_real_reqs.shape[0] != 1:
        raise ValueError(f"num_real_reqs must have shape [1], got {tuple(num_real_reqs.shape)}.")
    if error := wrong_device(device, owner, num_real_reqs=num_real_reqs):
        raise error


def check_counters(
    counters: torch.Tensor | None, device: torch.device | None, owner: str, counter_base: int | None = None
) -> None:
    """``None`` or the int64 ``[NUM_COUNTERS]`` vector of ``kvplan.counters`` on the kernels' device."""
    if counter_base is not None:
        check_counter_base(counter_base)
    if counters is None:
        return
    _expect_tensors(counters=counters)
    _expect_dtype("counters", counters, torch.int64)
    if counters.dim() != 1 or counters.shape[0] < NUM_COUNTERS or (counters.shape[0] > 1 and counters.stride(0) != 1):
        raise ValueError(
            f"counters must be a contiguous [>= {NUM_COUNTERS}] vector (kvplan.counters.new_counters), "
            f"got shape {tuple(counters.shape)} strides {counters.stride()}."
        )
    if error := wrong_device(device, owner, counters=counters):
        raise error


def check_rows(
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    device: torch.device | None,
    owner: str,
    names: tuple[str, str] = ("host_cache", "device_buffer"),
) -> None:
    """KV rows: same dtype and row width; the device buffer on the kernels' device, the host cache pinned (read
    zero-copy over the host link) or on that device too (``device=None``, the reference: any device). ``names``: the
    two arguments as the messages name them."""
    host, dev = names
    _expect_tensors(**{host: host_cache, dev: device_buffer})
    if error := wrong_shape(host, host_cache, shape="[host_rows, item]"):
        raise error
    rows_like_host = f"[device_rows, {{width}}] ({host}'s row width)"
    if error := wrong_shape(dev, device_buffer, width=host_cache.shape[1], shape=rows_like_host):
        raise error
    if device_buffer.shape[1] != host_cache.shape[1]:
        raise ValueError(f"{dev} must have {host}'s row width {host_cache.shape[1]}, got {device_buffer.shape[1]}.")
    if device_buffer.dtype != host_cache.dtype:
        raise ValueError(f"{dev} must have {host}'s dtype {host_cache.dtype}, got {device_buffer.dtype}.")
    if device is None:
        return
    if error := wrong_device(device, owner, **{dev: device_buffer}):
        raise error
    if device_key(host_cache.device) == device_key(device):
        return
    if device.type == "cuda" and host_cache.device.type == "cpu":
        # (not re-asked while a CUDA graph is being captured: the eager warm-up launch has checked it)
        if not torch.cuda.is_current_stream_capturing() and not host_cache.is_pinned():
            raise ValueError(
                f"{host} must be in pinned host memory to be read by the kernel over the host link, got an "
                "unpinned CPU tensor; allocate it with pin_memory=True."
            )
        return
    raise ValueError(f"{host} must be pinned CPU memory or on {device}, got {host_cache.device}.")


def check_sparse_block_size(sparse_block_size: object) -> int:
    """``sparse_block_size`` as an int >= 1 (tokens per selected block); ``TypeError``/``ValueError`` naming it."""
    if isinstance(sparse_block_size, bool) or not isinstance(sparse_block_size, int):
        raise TypeError(
            f"sparse_block_size must be an int >= 1 (tokens per selected block), got "
            f"{type(sparse_block_size).__name__} {sparse_block_size!r}."
        )
    if sparse_block_size < 1 or sparse_block_size > MAX_OCCURRENCES:
        raise ValueError(
            f"sparse_block_size must be in [1, {MAX_OCCURRENCES}] (tokens per selected block), got {sparse_block_size}."
        )
    return int(sparse_block_size)


def _check_block_selection(
    speculative: bool, sparse_block_size: object, top_k_blocks: object, top_k_device_locs: object
) -> None:
    """The block front end's own arguments (docs/kernels.md §2a): single-step, ``top_k_blocks`` int32 ``[B, NB]``,
    ``top_k_device_locs`` int32 ``[B, NB * sparse_block_size]``."""
    if speculative:
        raise ValueError("the block-selection swap-in is single-step: speculative must be False or None, got True.")
    block = check_sparse_block_size(sparse_block_size)
    _expect_tensors(top_k_blocks=top_k_blocks, top_k_device_locs=top_k_device_locs)
    if top_k_blocks.dim() != 2:
        raise ValueError(f"top_k_blocks must have shape [batch, num_blocks], got {tuple(top_k_blocks.shape)}.")
    batch, num_blocks = top_k_blocks.shape
    expected = (batch, num_blocks * block)
    if tuple(top_k_device_locs.shape) != expected:
        raise ValueError(
            f"top_k_device_locs must have shape [batch, num_blocks * sparse_block_size] = {expected} "
            f"({num_blocks} blocks of {block} tokens), got {tuple(top_k_device_locs.shape)}."
        )


def check_value_rows(
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    host_cache_v: torch.Tensor | None,
    device_buffer_v: torch.Tensor | None,
    device: torch.device | None,
    owner: str,
) -> None:
    """The V rows copied beside the K rows (``host_cache``/``device_buffer``, checked before): both or neither,
    each with its K twin's shape and dtype (one row index and one row pitch serve both), laid out as
    :func:`check_rows` requires."""
    if host_cache_v is None and device_buffer_v is None:
        return
    if host_cache_v is None or device_buffer_v is None:
        given, missing = (
            ("host_cache_v", "device_buffer_v") if device_buffer_v is None else ("device_buffer_v", "host_cache_v")
        )
        raise ValueError(f"host_cache_v and device_buffer_v must be given together: got {given} without {missing}.")
    _expect_tensors(host_cache_v=host_cache_v, device_buffer_v=device_buffer_v)
    for name, v, k, k_name in (("host_cache_v", host_cache_v, host_cache, "host_cache"),
                               ("device_buffer_v", device_buffer_v, device_buffer, "device_buffer")):  # fmt: skip
        if v.dtype != k.dtype:
            raise ValueError(f"{name} must have {k_name}'s dtype {k.dtype} (K and V rows alike), got {v.dtype}.")
        if tuple(v.shape) != tuple(k.shape):
            raise ValueError(
                f"{name} must have {k_name}'s shape {tuple(k.shape)} (one row index serves K and V), "
                f"got {tuple(v.shape)}."
            )
    check_rows(host_cache_v, device_buffer_v, device, owner, names=("host_cache_v", "device_buffer_v"))
    for name, v, k, k_name in (("host_cache_v", host_cache_v, host_cache, "host_cache"),
                               ("device_buffer_v", device_buffer_v, device_buffer, "device_buffer")):  # fmt: skip
        if v.shape[0] > 1 and v.stride(0) != k.stride(0):
            raise ValueError(
                f"{name} must have {k_name}'s row stride {k.stride(0)} (K and V rows share one row pitch), "
                f"got {v.stride(0)}."
            )


def check_swap_in(call: SwapInCall, *, launch: bool = True) -> SwapInDims:
    """Validate a swap-in call (``call.speculative`` picks the path); returns its sizes. ``launch=False`` (the
    reference) accepts tensors on any device and an unpinned host cache; everything else is checked the same."""
    (
        speculative,
        device_buffer_tokens,
        device_buffer_locs,
        lru_slots,
        host_cache_locs,
        scratch_locs,
        top_k_tokens,
        top_k_device_locs,
        req_pool_indices,
        seq_lens,
        host_cache,
        device_buffer,
        num_real_reqs,
        miss_src,
        miss_dst,
        miss_count,
        workspace,
        counters,
        check_newest,
        sparse_block_size,
        host_cache_v,
        device_buffer_v,
    ) = call.flat_blocks()
    blocks = sparse_block_size is not None
    tok_name = "top_k_blocks" if blocks else "top_k_tokens"
    if blocks:
        # the block front end (docs/kernels.md §2a): the selection's own checks, then the plan's against the output
        # (its capacity is the selected tokens, num_blocks * sparse_block_size)
        _check_block_selection(speculative, sparse_block_size, top_k_tokens, top_k_device_locs)
        check_miss_plan(top_k_device_locs, miss_src, miss_dst, miss_count)
    else:
        # The plan checks (docs/kernels.md §6 texts) also check top_k_tokens' rank.
        (check_spec_miss_plan if speculative else check_miss_plan)(top_k_tokens, miss_src, miss_dst, miss_count)
    _expect_tensors(
        device_buffer_tokens=device_buffer_tokens,
        host_cache_locs=host_cache_locs,
        device_buffer_locs=device_buffer_locs,
        host_cache=host_cache,
        device_buffer=device_buffer,
        top_k_device_locs=top_k_device_locs,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        lru_slots=lru_slots,
    )
    _expect_optional_tensors(num_real_reqs=num_real_reqs, scratch_locs=scratch_locs, workspace=workspace,
                             host_cache_v=host_cache_v, device_buffer_v=device_buffer_v)  # fmt: skip
    if error := check_newest_error(check_newest):  # (a record built field by field)
        raise error

    device = top_k_tokens.device
    if launch:
        _check_launchable(device, tok_name)
    _expect_dtype(tok_name, top_k_tokens, torch.int32)
    batch, top_k = top_k_tokens.shape[0], top_k_tokens.shape[-1]
    if blocks:
        top_k *= sparse_block_size  # the selected tokens: every occurrence is one token of one block
    steps = top_k_tokens.shape[1] if speculative else 1
    if steps < 1:
        raise ValueError(f"speculative top_k_tokens must have steps >= 1, got shape {tuple(top_k_tokens.shape)}.")
    if steps * top_k > MAX_OCCURRENCES:  # a table entry keeps an occurrence in 24 bits
        raise ValueError(
            f"top_k_tokens must have steps * top_k <= {MAX_OCCURRENCES} occurrences per row, "
            f"got shape {tuple(top_k_tokens.shape)}."
        )
    if not blocks and top_k_device_locs.shape != top_k_tokens.shape:
        raise ValueError(
            f"top_k_device_locs must have top_k_tokens' shape {tuple(top_k_tokens.shape)}, "
            f"got {tuple(top_k_device_locs.shape)}."
        )
    _expect_dtype("top_k_device_locs", top_k_device_locs, torch.int32)
    _expect_vector("req_pool_indices", req_pool_indices, batch)
    _expect_dtype("req_pool_indices", req_pool_indices, *_INDEX_DTYPES)
    _expect_vector("seq_lens", seq_lens, batch * steps)
    _expect_dtype("seq_lens", seq_lens, *_INDEX_DTYPES)

    # (the tables' shape, 2-D, dtype, stored-values and one-device rules are kvplan.table_rules', the state's too)
    if error := wrong_shape("device_buffer_tokens", device_buffer_tokens):
        raise error
    _expect_table_dtype("device_buffer_tokens", device_buffer_tokens)
    requests, width = device_buffer_tokens.shape
    if error := wrong_shape("device_buffer_locs", device_buffer_locs, requests, width):
        raise error
    if tuple(device_buffer_locs.shape) != (requests, width):  # rows too: the kernel reads row rid of both tables
        shape = tuple(device_buffer_locs.shape)
        raise ValueError(f"device_buffer_locs must have shape [{requests}, {width}], got {shape}.")
    _expect_table_dtype("device_buffer_locs", device_buffer_locs)
    if requests > 1 and (error := row_stride_error(device_buffer_tokens, device_buffer_locs)):  # (one row: unread)
        raise error
    if error := wrong_shape("lru_slots", lru_slots, requests, rows=True):
        raise error
    _expect_table_dtype("lru_slots", lru_slots)
    hot = lru_slots.shape[1]
    if hot < max(top_k, 1):
        if blocks:
            raise ValueError(
                f"lru_slots must have hot >= num_blocks * sparse_block_size = {top_k_tokens.shape[-1]} * "
                f"{sparse_block_size} = {top_k} (the selected tokens, and >= 1) columns, got hot = {hot}."
            )
        raise ValueError(f"lru_slots must have hot >= top_k = {top_k} (and >= 1) columns, got hot = {hot}.")
    if error := hot_error(hot):
        raise error
    if width <= hot:
        need = "the tail slots of the speculative path" if speculative else "slot hot, the newest token's"
        raise ValueError(
            f"device_buffer_tokens must have more than hot = {hot} columns (at least one tail slot: {need}), "
            f"got {width}."
        )
    if error := wrong_shape("host_cache_locs", host_cache_locs, requests, rows=True):
        raise error
    _expect_table_dtype("host_cache_locs", host_cache_locs)
    scratch = 0
    if scratch_locs is not None:
        if error := wrong_shape("scratch_locs", scratch_locs, requests, rows=True):
            raise error
        _expect_table_dtype("scratch_locs", scratch_locs)
        scratch = scratch_locs.shape[1]
    check_rows(host_cache, device_buffer, device if launch else None, tok_name)
    check_value_rows(host_cache, device_buffer, host_cache_v, device_buffer_v, device if launch else None, tok_name)
    check_num_real_reqs(num_real_reqs, device if launch else None, tok_name)
    check_counters(counters, device if launch else None, tok_name)
    if workspace is not None:
        columns = swap_in_workspace_columns(steps, top_k)
        _expect_dtype("workspace", workspace, torch.int64)
        if workspace.dim() != 2 or workspace.shape[0] < batch or workspace.shape[1] < columns:
            raise ValueError(
                f"workspace must have shape [>= {batch}, >= {columns}] (swap_in_workspace_columns({steps}, {top_k})), "
                f"got {tuple(workspace.shape)}."
            )
        if columns > 1 and workspace.stride(1) != 1:
            strides = workspace.stride()
            raise ValueError(f"workspace must have unit column stride (row-major rows), got strides {strides}.")
    error = wrong_device(
        device if launch else None,
        tok_name,
        top_k_device_locs=top_k_device_locs,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        device_buffer_tokens=device_buffer_tokens,
        device_buffer_locs=device_buffer_locs,
        lru_slots=lru_slots,
        host_cache_locs=host_cache_locs,
        scratch_locs=scratch_locs,
        workspace=workspace,
    )
    if error:
        raise error
    named = call.flat_blocks_dict()
    check_in_storage(**named)
    if error := unresolved_view(**named):
        raise error
    check_written(*swap_in_memory(call, batch, steps * top_k))
    return SwapInDims(
        batch=batch,
        steps=steps,
        top_k=top_k,
        requests=requests,
        hot=hot,
        width=width,
        max_len=host_cache_locs.shape[1],
        scratch=scratch,
    )


def check_copy(
    plan: MissPlan,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    *,
    num_real_reqs: torch.Tensor | None,
    counters: torch.Tensor | None,
    counter_base: int,
    launch: bool = True,
    workspace: torch.Tensor | None = None,
    host_cache_v: torch.Tensor | None = None,
    device_buffer_v: torch.Tensor | None = None,
) -> None:
    """Validate a ``copy_planned`` call: a plan of ``[batch, columns]`` slabs, ``[>= batch]`` counts, KV rows (with
    ``host_cache_v``/``device_buffer_v`` the V rows beside the K rows, :func:`check_value_rows`), and the swap-in
    workspace whose record of shared host rows it reads (int64 ``[>= batch, >= ceil((8 + columns) / 2)]``).
    ``launch=False`` (the reference) accepts tensors on any device."""
    if not isinstance(plan, MissPlan):
        raise TypeError(f"plan must be a kvplan.MissPlan, got {type(plan).__name__}.")
    miss_src, miss_dst, miss_count = plan.src, plan.dst, plan.count
    _expect_tensors(miss_src=miss_src, miss_dst=miss_dst, miss_count=miss_count)
    _expect_optional_tensors(num_real_reqs=num_real_reqs, counters=counters, workspace=workspace)
    device = miss_dst.device
    if launch:
        _check_launchable(device, "miss_dst")
    else:
        device = None
    if error := plan_dtype_error(miss_src, miss_dst, miss_count):  # (the validators' texts, docs/kernels.md §6)
        raise error
    if miss_src.dim() != 2 or miss_src.shape != miss_dst.shape:
        raise ValueError(
            f"miss_src and miss_dst must both have shape [batch, columns], got {tuple(miss_src.shape)} and "
            f"{tuple(miss_dst.shape)}."
        )
    batch, columns = miss_src.shape
    if batch > 1 and miss_src.stride(0) != miss_dst.stride(0):
        strides = (miss_src.stride(0), miss_dst.stride(0))
        raise ValueError(f"miss_src/miss_dst row strides must match, got {strides[0]} and {strides[1]}.")
    if columns > 1 and (miss_src.stride(1) != 1 or miss_dst.stride(1) != 1):
        raise ValueError(
            f"miss_src/miss_dst must have unit column stride, got strides {miss_src.stride()} and {miss_dst.stride()}."
        )
    if miss_count.dim() != 1 or miss_count.shape[0] < batch or (batch > 1 and miss_count.stride(0) != 1):
        raise ValueError(
            f"miss_count must be a contiguous [>= {batch}] vector (miss_src's rows), got shape "
            f"{tuple(miss_count.shape)} strides {miss_count.stride()}."
        )
    if error := wrong_device(device, "miss_dst", miss_src=miss_src, miss_count=miss_count):
        raise error
    check_rows(host_cache, device_buffer, device, "miss_dst")
    check_value_rows(host_cache, device_buffer, host_cache_v, device_buffer_v, device, "miss_dst")
    check_num_real_reqs(num_real_reqs, device, "miss_dst")
    check_counters(counters, device, "miss_dst", counter_base)
    if workspace is not None:
        _expect_dtype("workspace", workspace, torch.int64)
        words = -(-(ROW_WORDS + columns) // 2) if columns else 0  # (a plan without columns copies nothing)
        if workspace.dim() != 2 or workspace.shape[0] < batch or workspace.shape[1] < words:
            raise ValueError(
                f"workspace must be the swap-in workspace that wrote the plan: int64 [>= {batch}, >= {words}] "
                f"(the plan's rows, and (8 + {columns} columns) / 2 words), got {tuple(workspace.shape)}."
            )
        if workspace.shape[1] > 1 and workspace.stride(1) != 1:
            strides = workspace.stride()
            raise ValueError(f"workspace must have unit column stride (row-major rows), got strides {strides}.")
        if error := wrong_device(device, "miss_dst", workspace=workspace):
            raise error
    check_in_storage(
        miss_src=miss_src,
        miss_dst=miss_dst,
        miss_count=miss_count,
        host_cache=host_cache,
        device_buffer=device_buffer,
        num_real_reqs=num_real_reqs,
        counters=counters,
        workspace=workspace,
        host_cache_v=host_cache_v,
        device_buffer_v=device_buffer_v,
    )
    if error := unresolved_view(miss_src=miss_src, miss_dst=miss_dst, miss_count=miss_count, host_cache=host_cache,
                                device_buffer=device_buffer, num_real_reqs=num_real_reqs, counters=counters,
                                host_cache_v=host_cache_v, device_buffer_v=device_buffer_v):  # fmt: skip
        raise error
    check_written(*copy_memory(plan, host_cache, device_buffer, num_real_reqs, counters, workspace, host_cache_v,
                               device_buffer_v))  # fmt: skip


_KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_materialize_args(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    k_out: torch.Tensor | None,
    v_out: torch.Tensor | None,
) -> None:
    """Validate a ``materialize`` call: ``check_materialize`` (docs/kernels.md §6 texts), then what it leaves out: the
    outputs must not overlap themselves, each other or an input. At ``T == 0`` nothing after the §6 list is checked
    (docs/kernels.md §5: an empty context returns before any other check; nothing is read or written, and given
    outputs are returned as they are)."""
    check_materialize(
        kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out=k_out, v_out=v_out
    )
    if kv.shape[0] == 0:
        return
    if kv.dtype not in _KV_DTYPES:  # (a float8 kv would run, its K one rounding step off the reference's)
        raise ValueError(
            f"materialize: kv must be float16, bfloat16 or float32, got {kv.dtype}; cast it to one of them first."
        )
    check_in_storage(
        kv=kv,
        k_norm_weight=k_norm_weight,
        eps=eps,
        cos_sin_cache=cos_sin_cache,
        positions=positions,
        k_out=k_out,
        v_out=v_out,
    )
    if error := unresolved_view(kv=kv, k_norm_weight=k_norm_weight, eps=eps, cos_sin_cache=cos_sin_cache,
                                positions=positions, k_out=k_out, v_out=v_out):  # fmt: skip
        raise error
    check_written(*materialize_memory(kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out))


def check_positions_in_range(positions: torch.Tensor, max_pos: int) -> None:
    """Raise ValueError naming the positions outside ``[0, max_pos)``: the opt-in value check of materialize (it
    reads the positions, so it synchronises with the device; the kernel itself clamps)."""
    pos = positions.to(torch.int64)
    bad = ((pos < 0) | (pos >= max_pos)).nonzero().flatten()
    if bad.numel() == 0:
        return
    shown = bad[:8].tolist()
    values = pos[bad[:8]].tolist()
    more = f" (and {bad.numel() - len(shown)} more)" if bad.numel() > len(shown) else ""
    raise ValueError(
        f"positions out of range for cos_sin_cache: expected 0 <= position < {max_pos}, "
        f"got positions {values} at token indices {shown}{more}. "
        "Grow the cos/sin cache or fix the positions; unchecked, they are clamped."
    )


def eps_per_layer(eps: float | Sequence[float] | torch.Tensor, num_layers: int) -> torch.Tensor:
    """Per-layer epsilons as a float32 CPU tensor ``[Lyr]`` (one float is shared by every layer). Checked as given
    (float64), then as the kernel reads them: a value float32 rounds to 0 or inf is named as such. A NumPy array
    counts as a tensor of its values."""
    if type(eps).__module__ == "numpy" and type(eps).__name__ == "ndarray":
        eps = torch.tensor(eps.tolist(), dtype=torch.float64)
    if isinstance(eps, torch.Tensor):
        values = eps.detach().to("cpu", torch.float64).flatten()
        if eps.dim() > 1 or values.numel() not in (1, num_layers):
            raise ValueError(f"eps must have shape ({num_layers},) or be one value, got {tuple(eps.shape)}")
    elif as_float(eps) is not None:
        values = torch.tensor([as_float(eps)], dtype=torch.float64)
    elif isinstance(eps, Sequence) and not isinstance(eps, str) and all(as_float(e) is not None for e in eps):
        values = torch.tensor([as_float(e) for e in eps], dtype=torch.float64)
        if values.numel() != num_layers:
            raise ValueError(f"eps must hold {num_layers} values (one per layer), got {values.numel()}")
    else:
        raise TypeError(f"eps must be a float, a sequence of floats or a tensor, got {type(eps).__name__} {eps!r}")
    if not bool(torch.all((values > 0) & torch.isfinite(values))):
        raise ValueError(f"eps must be > 0 and finite, got {values.tolist()}")
    single = values.to(torch.float32)
    for given, stored in zip(values.tolist(), single.tolist()):
        if stored == 0.0 or stored == float("inf"):
            what = "underflows to 0" if stored == 0.0 else "overflows to inf"
            raise ValueError(
                f"eps must be representable in float32 (the kernel reads it as float32): {given!r} {what}; "
                f"use a value in [{torch.finfo(torch.float32).tiny:.3g}, {torch.finfo(torch.float32).max:.3g}]"
            )
    return single.expand(num_layers).clone()
