"""The engine-owned hot-buffer tables of docs/kernels.md §1, with helpers to build and maintain them.

Engines own this state; kvplan never reallocates it. ``HotBufferState`` exists so tests, benchmarks and the demo
build realistic state the same way an engine does, and so the per-step helpers (``write_tail``) show what is safe
inside a CUDA graph: every method is a handful of in-place device ops with no host synchronisation, provided the
values it is given (tokens, host rows, LRU orders) are already tensors on the state's device of a dtype that fits the
table's (values of a wider dtype are range-checked on the host: nothing is ever stored wrapped).

Lifecycle: the object also keeps host-side records (``lifecycle``, no device access, no tensors): which slots hold
a request admitted and not finished (:meth:`admit` refuses those unless told to replace), and :attr:`epoch`, which
counts the changes of which request a slot's hot rows belong to (``admit``, ``finish``, ``fill_short``, ``set_hot``).
A pool records the epoch with each swap-in and its ``replay`` refuses the plan once it moved: the plan's rows may now
be another request's. The records belong to the tables, not to the object: every ``HotBufferState`` built over the
same ``device_buffer_tokens`` view shares them, so a second wrapper (the SGLang adapter builds one per call) admits and
finishes in view of every pool. :meth:`check` reads the tables and names the first rule of the docs they break.
Inputs that are views of the tables are read before a helper writes anything.

Device rows: :meth:`allocate` gives slot ``j`` of request ``r`` the device row ``r * W + j`` and scratch row ``c`` of
request ``r`` the row ``R * W + r * C + c``, so a ``device_buffer`` of :attr:`device_rows` rows backs every slot and
scratch row exactly once.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet

import attrs
import torch
from torch import Tensor

from kvplan.config import as_device, as_int, check_cuda_device, int_in
from kvplan.errors import NotAnIntError, StateCheckError
from kvplan.sizing import scratch_rows as _scratch_rows
from kvplan.table_rules import (
    TABLE,
    hot_error,
    not_tensor,
    row_stride_error,
    unresolved_view,
    wrong_device,
    wrong_dtype,
    wrong_shape,
)

__all__ = ["HotBufferState"]

IntValues = Tensor | Sequence[int]
# Device rows are int32 in device_buffer_locs and scratch_locs: row numbers 0 .. 2^31 - 1.
MAX_DEVICE_ROWS = 1 << 31


def _check_table(instance: HotBufferState, attribute: attrs.Attribute, value: Tensor | None) -> None:
    """The table's own rules: its declared type and dtype (``kvplan.table_rules``, the call checks' too), then data
    (the state's). The tables' shapes, devices and stored values: ``HotBufferState.__attrs_post_init__``."""
    table = TABLE[attribute.name]
    if value is None and table.optional:
        return
    error = not_tensor(table.name, value) or wrong_dtype(table.name, value, table.dtype)
    if error is not None:
        raise error
    if value.is_meta:
        raise ValueError(f"{table.name} must hold data (the kernels read and write it), got a meta tensor.")


class Lifecycle:
    """A state's host-side request records (no tensors, so a pool may keep it without keeping the tables alive):
    ``epoch`` (changes of which request the slots' hot rows belong to) and ``live`` (by slot: admitted, not
    finished); ``rows``, the device rows :meth:`HotBufferState.allocate` laid out (``None`` for tables the engine
    built); and by slot, what the helpers were told, read without touching the device: ``backed`` (tokens ``0 ..
    backed - 1`` were backed by ``admit``/``append``, the tokens a request committed; ``set_host_rows`` and
    ``fill_short``, which may back tokens ahead of its length, reset it to 0) and ``newest``
    (the token ``write_tail`` put at slot ``HOT``: ``-1`` for an empty tail, ``None`` when unknown, e.g. given as a
    device tensor, or never written). ``stale``: the slots of long requests whose tail's newest token is older than
    a token ``append`` backed since (``write_tail`` was not called after the request grew)."""

    __slots__ = ("epoch", "live", "rows", "backed", "newest", "stale")

    def __init__(
        self,
        epoch: int,
        live: list[bool],
        rows: int | None = None,
        backed: list[int] | None = None,
        newest: list[int | None] | None = None,
        stale: set[int] | None = None,
    ) -> None:
        self.epoch, self.live, self.rows = epoch, live, rows
        self.backed = [0] * len(live) if backed is None else backed
        self.newest = [None] * len(live) if newest is None else newest
        self.stale = set() if stale is None else stale

    def copy(self) -> Lifecycle:
        return Lifecycle(self.epoch, list(self.live), self.rows, list(self.backed), list(self.newest), set(self.stale))


# One Lifecycle per tables: every HotBufferState over the same device_buffer_tokens view (the SGLang adapter builds one
# per call; an engine may wrap its tables again) shares its records, so no wrapper changes requests unseen. Keyed by the
# view and its storage, held by a weak reference to the storage (which keeps the storage's address from being reused
# while the entry lives; an expired entry is a new table's, and is replaced).
_LIFECYCLES: dict[tuple, tuple[object, Lifecycle]] = {}
_LIFECYCLES_LOCK = threading.Lock()


def _tables_lifecycle(tokens: Tensor, num_reqs: int) -> Lifecycle:
    """The records of the tables whose ``device_buffer_tokens`` is ``tokens`` (new ones for tables not seen yet)."""
    if torch.compiler.is_compiling():  # (a traced wrapper: no storage to key by; its helpers do not run compiled)
        return Lifecycle(0, [False] * num_reqs)
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        ref = StorageWeakRef(tokens.untyped_storage())
    except (ImportError, RuntimeError, NotImplementedError, AttributeError):  # a tensor without a plain storage
        return Lifecycle(0, [False] * num_reqs)
    key = (tokens.device, ref.cdata, tokens.storage_offset(), tuple(tokens.shape), tokens.stride())
    with _LIFECYCLES_LOCK:
        entry = _LIFECYCLES.get(key)
        if entry is not None and not entry[0].expired():
            return entry[1]
        if len(_LIFECYCLES) >= 256:
            for k in [k for k, (r, _) in _LIFECYCLES.items() if r.expired()]:
                del _LIFECYCLES[k]
        records = Lifecycle(0, [False] * num_reqs)
        _LIFECYCLES[key] = (ref, records)
        return records


@attrs.frozen(eq=False, slots=False)
class HotBufferState:
    """``device_buffer_tokens``/``device_buffer_locs`` ``[R, W]`` int32, ``lru_slots`` ``[R, HOT]`` int16,
    ``host_cache_locs`` ``[R, Lmax]`` int64 and optional ``scratch_locs`` ``[R, C]`` int32, all on one device.

    The tensors are mutated in place (by the kernels and by these helpers); the bindings never change. (Not slotted:
    the lifecycle records of the module docstring are the plain attribute ``lifecycle``, not a field, so
    ``attrs.fields`` lists the five tables only.)
    """

    device_buffer_tokens: Tensor = attrs.field(validator=_check_table)
    device_buffer_locs: Tensor = attrs.field(validator=_check_table)
    lru_slots: Tensor = attrs.field(validator=_check_table)
    host_cache_locs: Tensor = attrs.field(validator=_check_table)
    scratch_locs: Tensor | None = attrs.field(default=None, validator=_check_table)

    def __attrs_post_init__(self) -> None:
        """The tables' shapes, one device and stored values, by ``kvplan.table_rules`` and in the order of the call
        check (``check_swap_in``), so that tables breaking one rule get the call's text for it; the state words some
        relations of the tables its own way (``device_buffer_locs`` like ``device_buffer_tokens``; ``1 <= hot < W``;
        contiguous ``host_cache_locs`` rows; ``scratch_locs`` ``[R, C]``), and asks no row-major columns of them."""
        tokens, locs, lru, hosts, scratch = (
            self.device_buffer_tokens, self.device_buffer_locs, self.lru_slots, self.host_cache_locs, self.scratch_locs
        )  # fmt: skip
        if error := wrong_shape("device_buffer_tokens", tokens, columns=False):
            raise error
        num_reqs, width = tokens.shape
        if error := wrong_shape("device_buffer_locs", locs, num_reqs, width, columns=False):
            raise error
        if locs.shape != tokens.shape:
            raise ValueError(
                f"device_buffer_locs must have shape {(num_reqs, width)} like device_buffer_tokens, "
                f"got {tuple(locs.shape)}."
            )
        if error := row_stride_error(tokens, locs):  # (one row included)
            raise error
        if error := wrong_shape("lru_slots", lru, num_reqs, rows=True, columns=False):
            raise error
        hot = lru.shape[1]
        if not 1 <= hot < width:
            raise ValueError(
                f"lru_slots must have shape [{num_reqs}, hot] with 1 <= hot < {width} (at least one tail slot), "
                f"got {tuple(lru.shape)}."
            )
        if error := hot_error(hot):
            raise error
        if error := wrong_shape("host_cache_locs", hosts, num_reqs, rows=True, columns=False):
            raise error
        if hosts.stride(1) != 1:
            raise ValueError(
                f"host_cache_locs must have shape [{num_reqs}, max_len] with contiguous rows, "
                f"got shape {tuple(hosts.shape)} strides {hosts.stride()}."
            )
        if scratch is not None:
            if error := wrong_shape("scratch_locs", scratch, num_reqs, columns=False):
                raise error
            if scratch.shape[0] != num_reqs:
                raise ValueError(f"scratch_locs must have shape [{num_reqs}, C], got {tuple(scratch.shape)}.")
        error = wrong_device(
            tokens.device, "device_buffer_tokens", device_buffer_locs=locs, lru_slots=lru, host_cache_locs=hosts,
            scratch_locs=scratch,
        ) or unresolved_view(
            device_buffer_tokens=tokens, device_buffer_locs=locs, lru_slots=lru, host_cache_locs=hosts,
            scratch_locs=scratch,
        )  # fmt: skip
        if error:
            raise error
        object.__setattr__(self, "lifecycle", _tables_lifecycle(self.device_buffer_tokens, num_reqs))

    @classmethod
    def allocate(
        cls,
        num_reqs: int,
        hot: int,
        tail: int,
        max_len: int,
        device: torch.device | str = "cpu",
        *,
        scratch: int | None = None,
        steps: int | None = None,
        top_k: int | None = None,
    ) -> HotBufferState:
        """Empty state: no tokens, identity LRU, nothing backed; device rows as in the module docstring.

        Parameters
        ----------
        num_reqs, hot, tail, max_len : int
            Request slots ``R``, hot slots ``HOT``, tail slots ``P`` (the newest token and the drafts), tokens
            ``Lmax`` each request's host rows cover.
        device : torch.device or str
            Where the tables live.
        scratch : int, optional
            Scratch rows per request (speculative misses beyond the hot slots go there). ``None``: enough that no
            token ever overflows at the engine's largest ``steps`` x ``top_k`` (:func:`kvplan.sizing.scratch_rows`),
            or 0 without them.
        steps, top_k : int, optional
            The engine's largest draft steps and top-k, to size ``scratch``.

        ``device_buffer`` then needs :attr:`device_rows` = ``R * (HOT + tail + scratch)`` rows.
        """
        num_reqs, hot, tail, max_len = (
            _check_int(name, value, low)
            for name, value, low in (
                ("num_reqs", num_reqs, 1),
                ("hot", hot, 1),
                ("tail", tail, 1),
                ("max_len", max_len, 1),
            )  # fmt: skip
        )
        if scratch is None:
            if (steps is None) != (top_k is None):
                raise ValueError("steps and top_k size the scratch rows together: give both or neither.")
            scratch = 0 if steps is None else _scratch_rows(hot, steps, top_k)
        scratch = _check_int("scratch", scratch, 0)
        if top_k is not None and _check_int("top_k", top_k, 0) > hot:  # stated here first: refused here
            raise ValueError(
                f"hot must be at least top_k: each swap-in places a step's top_k tokens in the hot slots "
                f"(max(top_k, 1) <= hot), got hot = {hot}, top_k = {top_k}. Allocate hot >= {top_k} slots, or "
                "use a smaller top_k."
            )
        if error := hot_error(hot):  # (the tables' rule, before anything is allocated)
            raise error
        width = hot + tail
        rows = num_reqs * (width + scratch)
        if rows > MAX_DEVICE_ROWS:  # checked before anything is allocated: a row number would wrap in int32
            raise ValueError(
                f"num_reqs * (hot + tail + scratch) must be at most {MAX_DEVICE_ROWS} device rows (int32 row numbers "
                f"in device_buffer_locs and scratch_locs), got {num_reqs} * ({hot} + {tail} + {scratch}) = {rows} "
                "device rows. Use fewer requests or slots per worker."
            )
        device = as_device("HotBufferState.allocate", device)
        if device.type == "meta":
            raise ValueError("device must hold data (the kernels read and write the tables), got 'meta'.")
        check_cuda_device("HotBufferState.allocate", device)
        slot_rows = torch.arange(num_reqs * width, dtype=torch.int32, device=device).reshape(num_reqs, width)
        scratch_rows = None
        if scratch:
            first = num_reqs * width
            scratch_rows = torch.arange(first, first + num_reqs * scratch, dtype=torch.int32, device=device)
            scratch_rows = scratch_rows.reshape(num_reqs, scratch)
        state = cls(
            device_buffer_tokens=torch.full((num_reqs, width), -1, dtype=torch.int32, device=device),
            device_buffer_locs=slot_rows,
            lru_slots=torch.arange(hot, dtype=torch.int16, device=device).repeat(num_reqs, 1),
            host_cache_locs=torch.full((num_reqs, max_len), -1, dtype=torch.int64, device=device),
            scratch_locs=scratch_rows,
        )
        state.lifecycle.rows = rows  # the layout is known: a device_buffer needs this many rows
        return state

    # ---- geometry -------------------------------------------------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        """``R``: request-pool slots."""
        return self.device_buffer_tokens.shape[0]

    @property
    def hot(self) -> int:
        """``HOT``: LRU hot slots per request."""
        return self.lru_slots.shape[1]

    @property
    def width(self) -> int:
        """``W = HOT + P``: slots per request."""
        return self.device_buffer_tokens.shape[1]

    @property
    def tail(self) -> int:
        """``P``: tail slots (slot ``HOT`` holds the newest token, draft tokens follow)."""
        return self.width - self.hot

    @property
    def max_len(self) -> int:
        """``Lmax``: tokens ``host_cache_locs`` can back per request."""
        return self.host_cache_locs.shape[1]

    @property
    def scratch(self) -> int:
        """``C``: scratch rows per request (0 without ``scratch_locs``)."""
        return 0 if self.scratch_locs is None else self.scratch_locs.shape[1]

    @property
    def device(self) -> torch.device:
        return self.device_buffer_tokens.device

    @property
    def device_rows(self) -> int:
        """Rows a ``device_buffer`` needs for :meth:`allocate`'s tables: every slot and scratch row."""
        return self.num_reqs * (self.width + self.scratch)

    @property
    def epoch(self) -> int:
        """Changes so far of which request the slots' hot rows belong to (``admit``, ``finish``, ``fill_short``,
        ``set_hot``); a host int, read without touching the device."""
        return self.lifecycle.epoch

    def live(self, rid: int) -> bool:
        """Whether slot ``rid`` holds a request :meth:`admit` placed and :meth:`finish` has not freed."""
        return self.lifecycle.live[self._check_rid(rid)]

    def clone(self) -> HotBufferState:
        """An independent copy, e.g. to run the kernel and the reference from the same state (lifecycle records
        included)."""
        copy = attrs.evolve(
            self,
            device_buffer_tokens=self.device_buffer_tokens.clone(),
            device_buffer_locs=self.device_buffer_locs.clone(),
            lru_slots=self.lru_slots.clone(),
            host_cache_locs=self.host_cache_locs.clone(),
            scratch_locs=None if self.scratch_locs is None else self.scratch_locs.clone(),
        )
        records, mine = copy.lifecycle, self.lifecycle  # (the new tables' own records, shared by their wrappers)
        records.epoch, records.live[:], records.rows = mine.epoch, mine.live, mine.rows
        records.backed[:], records.newest[:] = mine.backed, mine.newest
        records.stale.clear()
        records.stale.update(mine.stale)
        return copy

    # ---- per-request updates (in place, no host sync) ----------------------------------------------------------------

    # A request's lifecycle: admit it into a free slot, append its tokens as it grows, finish it (the slot is free
    # again). Each writes the tables only; the engine writes the KV rows (device rows of hot slots, host rows).

    def admit(self, rid: int, host_rows: IntValues, *, replace: bool = False) -> None:
        """A new request in slot ``rid`` whose context so far (the prompt) is backed by ``host_rows`` (one host row
        per token). Tokens ``t < HOT`` sit at hot slot ``t``, so the engine writes their KV to device row
        ``device_buffer_locs[rid, t]`` during prefill; a longer prompt keeps only those in the hot slots, and later
        tokens come from the host when a top-k selects them. The tail is empty until :meth:`write_tail`.

        A slot admitted and not finished holds a live request: admitting over it is refused (``ValueError``) unless
        ``replace=True``. ``host_rows`` may be a view of the tables (a re-admit with the slot's own rows): it is read
        before the slot is cleared."""
        rid = self._check_rid(rid)
        if type(replace) is not bool:
            raise TypeError(f"replace must be a bool, got {type(replace).__name__} {replace!r}.")
        rows = self._values("host_rows", host_rows, torch.int64, self.max_len)  # refused before the slot is cleared
        if self.lifecycle.live[rid] and not replace:
            raise ValueError(
                f"rid {rid} holds a live request (admitted, not finished): admitting over it would drop it; "
                "finish(rid) first, or admit(rid, host_rows, replace=True) to replace it."
            )
        self.finish(rid)
        self.append(rid, 0, rows)
        self.lifecycle.live[rid] = True

    def append(self, rid: int, start: int, host_rows: IntValues) -> None:
        """Tokens ``start .. start + n - 1`` of request ``rid`` are backed by ``host_rows`` (``n`` rows): what each
        decode step adds. Those below ``HOT`` also take hot slot ``t`` (write their KV to ``device_buffer_locs[rid,
        t]``): a request is short while its length is at most ``HOT`` and resolves from the hot slots alone; past
        ``HOT`` the slots keep whatever the swap-ins placed there."""
        rid = self._check_rid(rid)
        first = int_in(start, 0, self.max_len, lambda: (
            f"start must be an int in [0, max_len = {self.max_len}] (the first token appended), got {start!r}."
        ))  # fmt: skip
        rows = self._values("host_rows", host_rows, torch.int64, self.max_len - first)
        stop = first + rows.shape[0]
        self.host_cache_locs[rid, first:stop].copy_(rows)
        if first < self.hot:
            slots = torch.arange(first, min(stop, self.hot), dtype=torch.int32, device=self.device)
            self.device_buffer_tokens[rid, first : min(stop, self.hot)].copy_(slots)
        records = self.lifecycle
        if stop > records.backed[rid]:
            records.backed[rid] = stop
            self._judge_tail(rid)

    def finish(self, rid: int) -> None:
        """Free request slot ``rid`` for reuse: no tokens, identity LRU, nothing backed (device rows are kept)."""
        rid = self._check_rid(rid)
        self._moved()
        records = self.lifecycle
        records.live[rid], records.backed[rid], records.newest[rid] = False, 0, None
        records.stale.discard(rid)
        self.device_buffer_tokens[rid].fill_(-1)
        self.lru_slots[rid].copy_(torch.arange(self.hot, dtype=torch.int16, device=self.device))
        self.host_cache_locs[rid].fill_(-1)

    def set_host_rows(self, rid: int, host_rows: IntValues) -> None:
        """Token ``t < len(host_rows)`` of ``rid`` is backed by host row ``host_rows[t]``; later tokens by none."""
        rid = self._check_rid(rid)
        rows = self._values("host_rows", host_rows, torch.int64, self.max_len)
        self.host_cache_locs[rid, : rows.shape[0]].copy_(rows)
        self.host_cache_locs[rid, rows.shape[0] :].fill_(-1)
        self.lifecycle.backed[rid] = 0  # (host rows set ahead of the request's length are fine: nothing to judge)
        self.lifecycle.stale.discard(rid)

    def fill_short(self, rid: int, seq_len: int, host_rows: IntValues) -> None:
        """A short request (``seq_len <= HOT``): token ``t`` at hot slot ``t``, identity LRU, empty tail.

        ``host_rows`` (``seq_len`` entries) backs the tokens on the host, as HiSparse keeps every token there.
        """
        rid = self._check_rid(rid)
        seq_len = int_in(seq_len, 0, self.hot, lambda: (
            f"seq_len must be in [0, hot = {self.hot}] for a short request, got {seq_len}."
        ))  # fmt: skip
        rows = self._values("host_rows", host_rows, torch.int64, self.max_len)
        if rows.shape[0] != seq_len:
            raise ValueError(f"host_rows must have seq_len = {seq_len} entries, got {rows.shape[0]}.")
        self._moved()
        tokens = self.device_buffer_tokens[rid]
        tokens[:seq_len].copy_(torch.arange(seq_len, dtype=torch.int32, device=self.device))
        tokens[seq_len:].fill_(-1)
        self.lru_slots[rid].copy_(torch.arange(self.hot, dtype=torch.int16, device=self.device))
        self.lifecycle.newest[rid] = None  # (the tail was emptied: nothing written there yet)
        self.set_host_rows(rid, rows)

    def set_hot(self, rid: int, slot_tokens: IntValues, lru: IntValues | None = None) -> None:
        """Hot slot ``j`` holds ``slot_tokens[j]`` (``-1`` empty; slots past the list empty); LRU order ``lru``
        (least recently used first, a permutation of ``0..HOT-1``; identity when ``None``). The tail is kept.

        With this and :meth:`set_host_rows` a long request's hot region can hold any set of tokens in any order.
        """
        rid = self._check_rid(rid)
        tokens = self._values("slot_tokens", slot_tokens, torch.int32, self.hot)
        order = torch.arange(self.hot, dtype=torch.int16, device=self.device)
        if lru is not None:
            order = self._values("lru", lru, torch.int16, self.hot)
            if order.shape[0] != self.hot:
                raise ValueError(f"lru must have hot = {self.hot} entries, got {order.shape[0]}.")
        self._moved()
        hot_tokens = self.device_buffer_tokens[rid, : self.hot]
        hot_tokens[: tokens.shape[0]].copy_(tokens)
        hot_tokens[tokens.shape[0] :].fill_(-1)
        self.lru_slots[rid].copy_(order)

    def write_tail(self, rid: int, tokens: IntValues) -> None:
        """Tail of ``rid``: the newest token at slot ``HOT``, draft tokens after it, the rest empty (run each step).

        Given on the host (a sequence, a NumPy array or a CPU tensor), the newest token is also recorded on the host:
        once :meth:`append` backs a token of a long request newer than it (the request grew and its tail was not
        written again), a pool's swap-in refuses the step instead of serving slot ``HOT``'s row, which holds an older
        token's KV (see :attr:`Lifecycle.stale`). A device tensor is not read (no synchronisation): nothing is
        recorded."""
        rid = self._check_rid(rid)
        values = self._values("tokens", tokens, torch.int32, self.tail)
        tail = self.device_buffer_tokens[rid, self.hot :]
        tail[: values.shape[0]].copy_(values)
        tail[values.shape[0] :].fill_(-1)
        self.lifecycle.newest[rid] = _first_on_host(tokens, values)
        self._judge_tail(rid)

    # ---- the rules, checked -----------------------------------------------------------------------------------------

    def check(
        self,
        req_pool_indices: Tensor | None = None,
        seq_lens: Tensor | None = None,
        *,
        steps: int = 1,
        top_k: int | None = None,
        num_real_reqs: Tensor | None = None,
    ) -> None:
        """Raise :class:`~kvplan.StateCheckError` naming the first rule of the docs (docs/kernels.md §1-§3,
        docs/integration.md) the tables break. It reads them on the host (a synchronisation): for bring-up and tests;
        the checked mode runs it before every swap-in, for the step's rows.

        - Without a step: every ``lru_slots`` row is a permutation of ``0..HOT-1`` and no token sits in two hot slots
          of one request.
        - ``req_pool_indices`` ``[B]`` and ``seq_lens`` ``[>= B * steps]`` (a step's, request-major; ``num_real_reqs``
          marks padding as the kernels read it): the same for the step's real rows, and for each of them, with ``L``
          its first step's length: a **short** request (last step's length ``<= HOT``) holds token ``t`` at hot slot
          ``t`` for every ``t < L`` (``admit``/``append``/``fill_short`` put it there: the engine writes its KV to
          ``device_buffer_locs[rid, t]``); a **long** one holds its newest token ``L - 1`` at tail slot ``HOT`` and
          each draft step's newest token in its tail (``write_tail``, every step).
        - ``top_k`` (with ``steps``): at least ``kvplan.scratch_rows(hot, steps, top_k)`` scratch rows, so no
          speculative swap-in drops a token.
        """
        from kvplan.sizing import scratch_rows as rule  # (the rule, one definition)

        steps = _check_int("steps", steps, 1)
        if top_k is not None:
            need = rule(self.hot, steps, top_k)
            if self.scratch < need:
                raise StateCheckError(
                    f"state.check: the state has {self.scratch} scratch rows per request; kvplan.sizing.scratch_rows("
                    f"hot={self.hot}, steps={steps}, top_k={top_k}) = {need} drop no token "
                    "(HotBufferState.allocate(..., steps=, top_k=) sizes them)"
                )
        tokens = self.device_buffer_tokens.cpu()
        lru = self.lru_slots.cpu()
        if req_pool_indices is None:
            if seq_lens is not None or num_real_reqs is not None:
                raise ValueError("state.check: seq_lens and num_real_reqs need req_pool_indices (a step's rows).")
            for rid in range(self.num_reqs):
                self._check_slots(rid, tokens[rid], lru[rid], "")
            self.check_tails()
            return
        if not isinstance(req_pool_indices, Tensor) or not isinstance(seq_lens, Tensor):
            raise TypeError("state.check: req_pool_indices and seq_lens must be tensors (a step's), given together.")
        rids, lens = req_pool_indices.reshape(-1).tolist(), seq_lens.reshape(-1).tolist()
        if len(lens) < len(rids) * steps:
            raise ValueError(f"state.check: seq_lens must have >= {len(rids)} x {steps} entries, got {len(lens)}.")
        real = len(rids) if num_real_reqs is None else min(max(int(num_real_reqs.reshape(-1)[0]), 0), len(rids))
        rows = [(b, rid) for b, rid in enumerate(rids[:real]) if 0 <= rid < self.num_reqs]  # (others are padding)
        self._check_step_rows(rows)
        hosts = None  # host_cache_locs on the host, read for the first long request
        for b, rid in rows:
            first, last = lens[b * steps], lens[b * steps + steps - 1]
            where = f"batch row {b} (request slot {rid}, length {first}): "
            row_lens = lens[b * steps : b * steps + steps]
            if any(later < earlier for earlier, later in zip(row_lens, row_lens[1:])):
                raise StateCheckError(
                    f"state.check: {where}seq_lens gives its {steps} draft steps the lengths {row_lens}, which "
                    f"decrease: seq_lens is request-major, seq_lens[b * {steps} + s] the length of batch row b at "
                    "step s (each row's steps together, e.g. [L0, L0 + 1, ..., L1, L1 + 1, ...]), not step-major"
                )
            self._check_slots(rid, tokens[rid], lru[rid], where)
            if last <= self.hot:
                held = tokens[rid, :first].tolist()
                wrong = next((t for t in range(first) if held[t] != t), None)
                if wrong is not None:
                    raise StateCheckError(
                        f"state.check: {where}a short request holds token {held[wrong]} at hot slot {wrong}, expected "
                        f"{wrong}: token t < HOT sits at hot slot t (state.admit / append / fill_short put it there; "
                        "prefill writes its KV to device_buffer_locs[rid, t])"
                    )
                continue
            tail = tokens[rid, self.hot :].tolist()
            newest = [lens[b * steps + s] - 1 for s in range(steps)]
            if tail[0] != newest[0] or any(t not in tail for t in newest):
                raise StateCheckError(
                    f"state.check: {where}a long request's tail holds {tail}, expected its newest token "
                    f"{newest[0]} at slot HOT = {self.hot} and each step's newest token {newest} in it: call "
                    f"state.write_tail(rid, {newest}) every step (the swap-in serves those tokens from the tail)"
                )
            if hosts is None:
                hosts = self.host_cache_locs.cpu()
            known = min(first - 1, self.max_len)  # tokens below the newest (which the tail serves)
            unbacked = (hosts[rid, :known] < 0).nonzero().flatten().tolist()
            held = set(tokens[rid].tolist())
            missing = [t for t in unbacked if t not in held]
            if missing:
                raise StateCheckError(
                    f"state.check: {where}token {missing[0]} (of {len(missing)} below its newest token "
                    f"{first - 1}) has no host row (host_cache_locs[{rid}, {missing[0]}] = -1) and no slot holds it: "
                    "a swap-in would output -1 for it, uncounted. Call state.append(rid, start, host_rows) for the "
                    "tokens each step commits (state.admit for the prompt)"
                )

    def _check_step_rows(self, rows: list[tuple[int, int]]) -> None:
        """The step's real rows ``(b, rid)``: distinct request slots, and no device row (of a slot or a scratch row)
        that two of their slots share: the swap-in writes each slot's tokens, LRU row and device rows as its own."""
        seen: dict[int, int] = {}
        for b, rid in rows:
            if rid in seen:
                raise StateCheckError(
                    f"state.check: batch rows {seen[rid]} and {b} both name request slot {rid}: the real rows of a "
                    "step have distinct request slots (req_pool_indices[b] is batch row b's slot; a slot's tables "
                    "serve one row per step: docs/kernels.md §2, preconditions). Give each request one batch row, or "
                    f"mark the extra rows as padding (num_real_reqs, or a slot outside [0, {self.num_reqs}))"
                )
            seen[rid] = b
        if not rows:
            return
        slots = torch.tensor([rid for _, rid in rows], device=self.device)
        owned = [self.device_buffer_locs[slots]]
        if self.scratch_locs is not None:
            owned.append(self.scratch_locs[slots])
        owner = torch.cat(owned, dim=1).to(torch.int64).cpu()  # [rows, W + C]: each real slot's device rows
        slot_of = torch.arange(len(rows)).unsqueeze(1).expand_as(owner)
        live = owner >= 0
        values, slot_ids = owner[live], slot_of[live]
        order = torch.argsort(values, stable=True)
        values, slot_ids = values[order], slot_ids[order]
        clash = (values[1:] == values[:-1]) & (slot_ids[1:] != slot_ids[:-1])
        if bool(clash.any()):
            i = int(clash.nonzero()[0])
            a, c = sorted((rows[int(slot_ids[i])][1], rows[int(slot_ids[i + 1])][1]))
            raise StateCheckError(
                f"state.check: device row {int(values[i])} belongs to request slots {a} and {c} (a slot's or a scratch "
                "row in device_buffer_locs / scratch_locs): the swap-in copies a slot's misses into its own device "
                "rows, so no two request slots of a step share one"
            )

    def _check_slots(self, rid: int, tokens: Tensor, lru: Tensor, where: str) -> None:
        """Slot ``rid``'s LRU row is a permutation and no token sits in two of its hot slots."""
        order = lru.to(torch.int64).sort().values
        if not torch.equal(order, torch.arange(self.hot)):
            raise StateCheckError(
                f"state.check: {where}lru_slots[{rid}] must be a permutation of 0..{self.hot - 1}, got "
                f"{lru[:8].tolist()}{'...' if self.hot > 8 else ''}"
            )
        hot = tokens[: self.hot].to(torch.int64)
        held = hot[hot >= 0]
        values, counts = held.unique(return_counts=True)
        if bool((counts > 1).any()):
            token = int(values[counts > 1][0])
            slots = (hot == token).nonzero().flatten().tolist()
            raise StateCheckError(
                f"state.check: {where}request slot {rid} holds token {token} in hot slots {slots}: a token sits in at "
                "most one hot slot"
            )

    def check_tails(self, call: str = "state.check") -> None:
        """Raise :class:`~kvplan.StateCheckError` when a long request's tail is known to be stale: :meth:`append` backed
        a token newer than the newest token :meth:`write_tail` last put at slot ``HOT`` (given on the host). Reads host
        records only (no device access): a pool runs it before every swap-in."""
        stale = self.lifecycle.stale
        if not stale:
            return
        rid = min(stale)
        records = self.lifecycle
        newest, backed = records.newest[rid], records.backed[rid]
        held = "an empty tail" if newest == -1 else f"newest token {newest} at slot HOT = {self.hot}"
        raise StateCheckError(
            f"{call}: request slot {rid}'s tail is stale: state.append backed its tokens up to {backed - 1}, but its "
            f"tail holds {held} (the last state.write_tail), so a swap-in would serve its newest token from slot "
            f"HOT's device row, which holds another token's KV. Call state.write_tail({rid}, [newest, drafts...]) "
            f"(their KV to state.device_buffer_locs[{rid}, HOT:]) every step after the request grows, or "
            f"state.finish({rid}) once it is done. Nothing was launched."
        )

    # ---- helpers ----------------------------------------------------------------------------------------------------

    def _judge_tail(self, rid: int) -> None:
        """Whether slot ``rid``'s tail is stale now (:attr:`Lifecycle.stale`), by the host records alone."""
        records = self.lifecycle
        newest, backed = records.newest[rid], records.backed[rid]
        if newest is not None and backed > self.hot and backed - 1 > newest:
            records.stale.add(rid)
        else:
            records.stale.discard(rid)

    def _moved(self) -> None:
        """Which request a slot's hot rows belong to changes: plans of earlier swap-ins no longer apply."""
        self.lifecycle.epoch += 1

    def _check_rid(self, rid: int) -> int:
        index = rid if type(rid) is int else as_int(rid)
        if index is None:
            raise NotAnIntError(f"rid must be an int in [0, {self.num_reqs}), got {type(rid).__name__} {rid!r}.")
        if not 0 <= index < self.num_reqs:
            raise ValueError(f"rid must be an int in [0, {self.num_reqs}), got {rid!r}.")
        return index

    def _values(self, name: str, values: IntValues, dtype: torch.dtype, most: int) -> Tensor:
        """``values`` as a 1-D tensor on the state's device (a device tensor is used without a copy to the host).
        Ordered values only: a tensor, a NumPy array, or a sequence (or other ordered iterable) of ints."""
        in_range = False  # a list's values are range-checked here; a tensor's (or an array's) by _check_fits
        if isinstance(values, Tensor):
            tensor = values
        elif isinstance(values, AbstractSet | Mapping):  # their iteration order is not the tokens' order
            raise TypeError(
                f"{name} must be an ordered sequence (list, tuple, range, tensor or NumPy array), got "
                f"{type(values).__name__}: its iteration order is not the order of the tokens."
            )
        elif hasattr(type(values), "__array__"):  # a NumPy array: its own dtype, then checked as a tensor
            try:
                tensor = torch.as_tensor(values)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise TypeError(f"{name} must hold integers, got {type(values).__name__} ({exc})") from None
        else:
            try:
                given = list(values)
            except TypeError:
                raise TypeError(f"{name} must be a tensor or a sequence of ints, got {type(values).__name__}") from None
            items = [v if type(v) is int else as_int(v) for v in given]
            if any(v is None for v in items):
                raise TypeError(f"{name} must hold ints, got {given[:8]!r}{'...' if len(given) > 8 else ''}.")
            info = torch.iinfo(dtype)
            if items and not info.min <= min(items) <= max(items) <= info.max:
                low, high = min(items), max(items)
                raise ValueError(f"{name} must fit {dtype} ([{info.min}, {info.max}]), got values in [{low}, {high}].")
            tensor, in_range = torch.as_tensor(items, dtype=torch.int64), True
        if tensor.is_meta:
            raise ValueError(f"{name} must hold data, got a meta tensor.")
        if tensor.dim() != 1 or tensor.shape[0] > most:
            raise ValueError(f"{name} must be 1-D with at most {most} entries, got shape {tuple(tensor.shape)}.")
        if tensor.dtype.is_floating_point or tensor.dtype == torch.bool or tensor.is_complex():
            raise ValueError(f"{name} must hold integers, got {tensor.dtype}.")
        if not in_range and tensor.numel():
            _check_fits(name, tensor, dtype)
        out = tensor.to(self.device, dtype)
        if out is tensor and tensor.numel() and self._shares_tables(tensor):
            out = tensor.clone()  # a view of the tables: read now, before a helper writes them
        return out

    def _shares_tables(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` lies in the storage of one of the tables (e.g. ``host_cache_locs[rid, :n]``)."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(
            t is not None and t.untyped_storage().data_ptr() == ptr
            for t in (self.device_buffer_tokens, self.device_buffer_locs, self.lru_slots, self.host_cache_locs,
                      self.scratch_locs)
        )  # fmt: skip


def _first_on_host(given: object, values: Tensor) -> int | None:
    """The first of ``write_tail``'s tokens as given, when it is on the host (``-1``: none given); ``None`` when
    reading it would touch a device (a CUDA tensor) or the input was an iterator :meth:`HotBufferState._values`
    consumed."""
    if values.shape[0] == 0:
        return -1
    if values.device.type == "cpu":
        return int(values[0])
    if isinstance(given, Tensor):
        return int(given.reshape(-1)[0]) if given.device.type == "cpu" else None
    if isinstance(given, Sequence) or hasattr(type(given), "__array__"):
        return int(given[0])
    return None


def _check_fits(name: str, tensor: Tensor, dtype: torch.dtype) -> None:
    """Values of an integer tensor must fit the table's ``dtype`` (a cast would wrap them silently). A dtype whose
    range fits needs no look at the values; a wider one is range-checked on the host (a device synchronisation,
    refused while a CUDA graph is being captured)."""
    info, given = torch.iinfo(dtype), torch.iinfo(tensor.dtype)
    if info.min <= given.min and given.max <= info.max:
        return
    if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            f"{name} must be {dtype} or a narrower integer dtype while a CUDA graph is being captured, got "
            f"{tensor.dtype}: checking that its values fit {dtype} would read them on the host."
        )
    values = tensor
    if tensor.dtype == torch.uint64:  # (few ops exist for the wide unsigned dtypes; read them as signed words)
        values = tensor.view(torch.int64)
        if bool((values < 0).any()):
            raise ValueError(f"{name} must fit {dtype} ([{info.min}, {info.max}]), got values of 2**63 or more.")
    elif not tensor.dtype.is_signed and tensor.element_size() > 1:
        values = tensor.to(torch.int64)
    low, high = (int(v) for v in torch.aminmax(values))
    if not info.min <= low <= high <= info.max:
        raise ValueError(f"{name} must fit {dtype} ([{info.min}, {info.max}]), got values in [{low}, {high}].")


def _check_int(name: str, value: int, low: int) -> int:
    return int_in(value, low, None, lambda: f"{name} must be an int >= {low}, got {value!r}.")
