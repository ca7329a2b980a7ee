"""Device-side swap-in counters: one int64 vector the kernels add to, read only when stats are asked for.

Keeping them on the device means no per-step host synchronisation; the pool owns one vector and hands it to every
launch. The reference implementations accept the same vector so tests can compare counts exactly.
"""

from __future__ import annotations

import torch

from kvplan.errors import NotAnIntError

# Index of each counter in the vector. Kernels take the vector and add with atomics.
MISSES_COPIED = 0  # rows copied host->device by swap-in (admitted + scratch copies)
BYTES_MOVED = 1  # bytes of those rows
HITS = 2  # distinct wanted tokens found in the hot region
OVERFLOW = 3  # speculative misses that found neither an evictable slot nor a scratch row (output -1)
REPLAYED_ROWS = 4  # rows copied by plan replay for shared-index layers
REPLAYED_BYTES = 5  # bytes of those rows

NAMES = ("misses_copied", "bytes_moved", "hits", "overflow", "replayed_rows", "replayed_bytes")
NUM_COUNTERS = len(NAMES)

# copy kernels add (rows, bytes) at (base, base + 1)
SWAP_IN_COPY_BASE = MISSES_COPIED
REPLAY_COPY_BASE = REPLAYED_ROWS


def check_counter_base(counter_base: object) -> None:
    """A copy adds (rows, bytes) at (base, base + 1): both must fall inside the vector."""
    if type(counter_base) is int and 0 <= counter_base <= NUM_COUNTERS - 2:
        return
    message = f"counter_base must be an int in [0, {NUM_COUNTERS - 2}], got {counter_base!r}."
    # a Python int only (a private knob, keyed by its type): a bool or NumPy int is the wrong type
    raise (ValueError if type(counter_base) is int else NotAnIntError)(message)


def new_counters(device: torch.device | str) -> torch.Tensor:
    """A zeroed counter vector on ``device``."""
    return torch.zeros(NUM_COUNTERS, dtype=torch.int64, device=device)


def read_counters(counters: torch.Tensor) -> dict[str, int]:
    """Host copy of the counters as a name -> int dict (this synchronises with the device)."""
    values = counters.detach().to("cpu").tolist()
    return dict(zip(NAMES, (int(v) for v in values)))
