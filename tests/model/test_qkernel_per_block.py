"""The compiled per-block scales of factored (K-quant) blocks equal torch's broadcast product bit
for bit: float16 and float32 group scales (zeros of both signs, subnormals, the extremes) times
unsigned and signed steps (#28: the broadcast multiply cost as much as the de-quantisation)."""

from __future__ import annotations

import pytest
import torch

from edge_runtime.model import qkernel, qweights

EDGE = torch.tensor([0.0, -0.0, 6e-8, -6e-8, 6.1e-5, 65504.0, -65504.0, 1.0, -0.5, 3e-3], dtype=torch.float16)


def _torch_product(base, steps):
    n, groups = base.shape
    return (base.float().unsqueeze(-1) * steps.float().view(n, groups, -1)).view(n, -1)


@pytest.mark.parametrize("base_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("steps_dtype", [torch.uint8, torch.int8])
@pytest.mark.parametrize("groups, per", [(1, 8), (3, 16), (4, 1)])
def test_compiled_per_block_scales_equal_torch_bit_for_bit(base_dtype, steps_dtype, groups, per):
    if not qkernel.available(torch.zeros(1, dtype=torch.uint8)):
        pytest.skip("no C compiler here: torch's product is the only path")
    gen = torch.Generator().manual_seed(groups * per)
    n = 5
    base = EDGE[torch.randint(0, len(EDGE), (n, groups), generator=gen)].to(base_dtype)
    low, high = (-128, 128) if steps_dtype == torch.int8 else (0, 256)
    steps = torch.randint(low, high, (n, groups * per), generator=gen).to(steps_dtype)
    got = qkernel.per_block(base, steps)
    want = _torch_product(base, steps)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0 kept where torch has it
    # and through the blocks' own reader, on row views (a product's tile) as well
    assert torch.equal(qweights._per_block(base[1:4], steps[1:4]).view(torch.int32), want[1:4].view(torch.int32))
