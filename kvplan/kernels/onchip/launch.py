"""Launching the on-chip resolve: load its cubin once per device and build, launch it on torch's current stream.

``cuda-core`` (NVIDIA's Python CUDA layer; a dependency of the GPU install, imported only here and only for a CUDA
device) loads the cubin that :mod:`kvplan.kernels.onchip.compiler` built and launches it on the stream torch is
using, so CUDA graphs, side streams and the ``kvplan.ops`` custom ops see it like any kernel of torch's. A launch is
recorded as a callable with its arguments packed, so a pool's launch records relaunch it without building them again.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch

from kvplan.kernels.onchip.compiler import KERNEL_NAME, OnChipConfig, compile_resolve, shared_bytes

__all__ = ["unavailable", "launch_resolve"]

_LOCK = threading.Lock()


class _TorchStream:
    """A torch stream as cuda-core's ``__cuda_stream__`` protocol names one."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


@functools.cache
def _cuda_core_missing() -> str | None:
    """Why cuda-core cannot launch here (None when it can)."""
    try:
        import cuda.bindings.nvrtc  # noqa: F401
        import cuda.core  # noqa: F401
    except Exception as error:  # ImportError, or a CUDA library that does not load
        return f"cuda-core/cuda-bindings not importable ({type(error).__name__}: {error})"
    return None


@functools.cache
def _device_limits(device: torch.device) -> tuple[str, int]:
    """The device's architecture (``sm_90``) and the shared memory one block may opt into."""
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    return f"sm_{props.major}{props.minor}", int(optin)


def unavailable(device: torch.device, config: OnChipConfig) -> str | None:
    """Why the on-chip resolve cannot run this call on ``device`` (None when it can): not a CUDA device, cuda-core
    missing, sizes past the kernel's limits, or more shared memory than a block may take."""
    if device.type != "cuda":
        return f"device {device} is not a CUDA device"
    if not config.fits():
        return f"sizes past the on-chip limits (S*K={config.occurrences}, HOT={config.hot})"
    missing = _cuda_core_missing()
    if missing:
        return missing
    arch, optin = _device_limits(device)
    need = shared_bytes(config)
    if need > optin:
        return f"{need} bytes of shared memory per block, {arch} allows {optin}"
    return None


class _Loaded:
    """One build loaded on one device: its kernel, launch configuration, and the cuda-core streams made so far (one
    per torch stream handle)."""

    def __init__(self, config: OnChipConfig, device: torch.device) -> None:
        from cuda.bindings import driver
        from cuda.core import Device, ObjectCode

        arch, _ = _device_limits(device)
        build = compile_resolve(config, arch)
        self.device = Device(device.index if device.index is not None else torch.cuda.current_device())
        self.device.set_current()
        self.kernel = ObjectCode.from_cubin(build.cubin).get_kernel(KERNEL_NAME)
        smem = shared_bytes(config)
        (error,) = driver.cuKernelSetAttribute(
            driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem, self.kernel.handle, int(self.device.device_id),
        )  # fmt: skip
        if error != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuKernelSetAttribute(max dynamic shared memory = {smem}): {error}")
        self.shared = smem
        self.threads = config.threads
        self.build = build
        self.streams: dict[int, object] = {}

    def stream(self, handle: int):
        stream = self.streams.get(handle)
        if stream is None:
            stream = self.streams[handle] = self.device.create_stream(_TorchStream(handle))
        return stream

    def launch(self, grid: int, args: tuple, device: torch.device) -> None:
        from cuda.core import LaunchConfig, launch

        stream = self.stream(torch.cuda.current_stream(device).cuda_stream)
        launch(stream, LaunchConfig(grid=grid, block=self.threads, shmem_size=self.shared), self.kernel, *args)


_LOADED: dict[tuple, _Loaded] = {}


def _loaded(config: OnChipConfig, device: torch.device) -> _Loaded:
    key = (config, device)
    found = _LOADED.get(key)
    if found is None:
        with _LOCK:
            found = _LOADED.get(key)
            if found is None:
                found = _LOADED[key] = _Loaded(config, device)
    return found


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def launch_resolve(recorder, a, config: OnChipConfig) -> None:
    """Launch the on-chip resolve of a checked call (``a``: ``ResolveArgs``) and record it for relaunch."""
    device = a.tokens.device
    loaded = _loaded(config, device)
    call = a.call
    i64, i32 = np.int64, np.int32
    dbt, dbl, lru, hcl, scratch, strides, sizes = a.tables
    rpi_stride, seq_stride, batch, requests = a.batch_indexing
    args = (
        _ptr(a.tokens), *(i64(s) for s in a.tokens.stride()),
        _ptr(a.out), *(i64(s) for s in a.out.stride()),
        _ptr(call.req_pool_indices), i64(rpi_stride), _ptr(call.seq_lens), i64(seq_stride),
        _ptr(a.num_real), i32(batch), i32(requests),
        _ptr(dbt), _ptr(dbl), i64(strides[0]), _ptr(lru), i64(strides[1]), _ptr(hcl), i64(strides[2]), i64(sizes[0]),
        _ptr(scratch), i64(strides[3]), i32(sizes[1]),
        _ptr(a.plan.src), _ptr(a.plan.dst), i64(a.plan.src.stride(0)), _ptr(a.plan.count),
        _ptr(a.ws32), i64(a.ws_stride), _ptr(a.counters), i64(a.kv_rows[0]),
    )  # fmt: skip
    grid = int(batch)

    def run() -> None:
        loaded.launch(grid, args, device)

    run()
    recorder.launch_callable(run)
