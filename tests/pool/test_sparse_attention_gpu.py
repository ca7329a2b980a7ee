"""End-to-end sparse attention at production shapes on the GPU (K = 2048, HOT = 4096, 576-byte rows, S = 4)."""

import pytest
import torch

from kvplan.testing.sparse_attention import AttentionCheckConfig, SparseAttentionCheck

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("spec_steps", [1, 4], ids=["single", "spec4"])
def test_production_shapes_attend_exactly(spec_steps):
    config = AttentionCheckConfig(
        batch=4,
        hot=4096,
        tail=64,
        scratch=256,
        top_k=2048,
        spec_steps=spec_steps,
        context=20000,
        max_len=20064,
        dim=288,
        v_dim=256,
        heads=4,
        dtype=torch.bfloat16,
    )
    check = SparseAttentionCheck(config, "cuda")
    results = [check.step() for _ in range(3)]
    assert all(r.ok and r.exact for r in results), results
    assert results[0].misses_copied > 0


def test_whole_context_selected_matches_dense_attention():
    config = AttentionCheckConfig(
        batch=4, hot=4096, tail=64, top_k=2048, spec_steps=4, context=1500, max_len=2048, dim=288, v_dim=256, heads=4
    )
    results = [SparseAttentionCheck(config, "cuda").step()]
    assert all(r.ok for r in results) and results[0].dense_checked == 16, results
