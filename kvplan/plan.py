"""The miss plan: which host rows a swap-in copied to which device rows, for later layers to replay."""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from kvplan.config import as_device, as_int, int_in, sizes

__all__ = ["MissPlan"]


@attrs.frozen(eq=False)
class MissPlan:
    """One step's miss plan: ``src`` int64 and ``dst`` int32 ``[batch, >= steps * top_k]`` with one row stride (host
    and device row of each copy), ``count`` int32 ``[>= batch]`` (copies per batch row).

    A pool hands out views of its buffers with the ``generation`` they belong to (stale after a later growth); a plan
    of caller-owned tensors has ``generation=None``. Entries ``[0, count[b])`` of row ``b`` are defined after a
    swap-in; the rest is left as it was.
    """

    src: Tensor
    dst: Tensor
    count: Tensor
    generation: int | None = None

    def __attrs_post_init__(self) -> None:
        """Three tensors with data and an int (or None) generation; everything else is the launch checks' business.
        Plans are built on eager launch paths, so this is one call of a few checks (about 0.2 µs)."""
        src, dst, count, generation = self.src, self.dst, self.count, self.generation
        if not (isinstance(src, Tensor) and isinstance(dst, Tensor) and isinstance(count, Tensor)):
            _refuse_tensors(self)
        if src.is_meta or dst.is_meta or count.is_meta:
            _refuse_tensors(self)
        if generation is not None and type(generation) is not int:
            object.__setattr__(self, "generation", _generation(generation))
        elif generation is not None and generation < 0:
            _generation(generation)

    def row_copies(self, row: int, count: int | None = None) -> list[tuple[int, int]]:
        """Row ``row``'s first ``count`` (default ``count[row]``) copies as sorted ``(host row, device row)`` pairs:
        a plan row is a set of copies, the order of its entries is free (swap-ins write host-row order, the
        reference miss order), so two plans are compared this way. Reads the device (a synchronisation).

        ``row`` must be in ``[0, batch)`` (no negative indexing: ``-1`` is no plan row) and ``count`` in
        ``[0, columns]``; a stored ``count[row]`` is clamped to ``[0, columns]`` as the plan copy clamps it."""
        batch, columns = self.src.shape[0], self.src.shape[-1]
        row = int_in(row, 0, batch - 1, lambda: f"MissPlan.row_copies: row must be an int in [0, {batch}), got {row!r}")
        if count is None:
            n = min(max(int(self.count[row]), 0), columns)
        else:
            n = int_in(count, 0, columns, lambda: (
                f"MissPlan.row_copies: count must be an int in [0, {columns}] (the plan's columns), got {count!r}"
            ))  # fmt: skip
        return sorted(zip(self.src[row, :n].tolist(), self.dst[row, :n].tolist()))

    @classmethod
    def allocate(cls, batch: int, columns: int, device: torch.device | str) -> MissPlan:
        """A caller-owned plan of ``[batch, columns]`` rows (``columns = steps * top_k``), contents undefined."""
        batch, columns = sizes("MissPlan.allocate", batch=batch, columns=columns)
        device = as_device("MissPlan.allocate", device)
        if device.type == "meta":
            raise ValueError("MissPlan.allocate: device must hold data (a plan is written and read), got 'meta'")
        return cls(*new_plan_tensors(batch, columns, device))


def _refuse_tensors(plan: MissPlan) -> None:
    for name in ("src", "dst", "count"):
        value = getattr(plan, name)
        if not isinstance(value, Tensor):
            raise TypeError(f"MissPlan.{name} must be a torch.Tensor, got {type(value).__name__} {value!r}")
        if value.is_meta:
            raise ValueError(f"MissPlan.{name} must hold data (kernels write and read it), got a meta tensor")


def _generation(value: object) -> int:
    generation = as_int(value)
    if generation is None:
        raise TypeError(f"MissPlan.generation must be an int or None, got {type(value).__name__} {value!r}")
    if generation < 0:
        raise ValueError(f"MissPlan.generation must be >= 0, got {generation}")
    return generation


def traceable_plan(src: Tensor, dst: Tensor, count: Tensor, generation: int | None) -> MissPlan:
    """A ``MissPlan`` built field by field, as attrs' generated ``__init__`` does, without its post-init checks (the
    pool's own views need none). Dynamo cannot trace that ``__init__`` of a frozen slotted class (it binds
    ``object.__setattr__`` through a descriptor), nor compile its frame alone after a graph break in a caller."""
    plan = object.__new__(MissPlan)
    for name, value in (("src", src), ("dst", dst), ("count", count), ("generation", generation)):
        object.__setattr__(plan, name, value)
    return plan


def new_plan_tensors(batch: int, columns: int, device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
    """New ``(src, dst, count)``: int64 and int32 ``[batch, columns]``, int32 ``[batch]``, contents undefined (the one
    construction of a plan's tensors: ``MissPlan.allocate`` and the traced ops' plan)."""
    return (
        torch.empty(batch, columns, dtype=torch.int64, device=device),
        torch.empty(batch, columns, dtype=torch.int32, device=device),
        torch.empty(batch, dtype=torch.int32, device=device),
    )
