"""Drop-in entry points with other engines' public signatures, backed by kvplan's kernels.

``kvplan.compat.sglang``: SGLang's HiSparse host-to-device ops (``load_cache_to_device_buffer_mla``,
``copy_cache_planned_mla``, ``load_cache_to_device_buffer_spec_mla``) and its DFlash ``FusedKVMaterializeHelper``.
The contract, the differences from SGLang and the refusals are in docs/sglang.md.

Submodules are imported on use only, so ``import kvplan.compat`` pulls in neither Triton nor an engine.
"""

__all__ = ["sglang"]
