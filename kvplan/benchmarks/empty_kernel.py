"""An empty Triton kernel: the launch-cost floor the eager benchmark measures beside kvplan's calls."""

import triton
import triton.language as tl


@triton.jit
def empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pass
