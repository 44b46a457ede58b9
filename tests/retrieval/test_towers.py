"""The tower calls its layers as functions: the same bits as the modules it holds, both ways."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from retrieval.towers import Tower


def reference(tower: Tower, parts: list[torch.Tensor]) -> torch.Tensor:
    return F.normalize(tower.mlp(torch.cat(parts, dim=1)), dim=1)


def test_the_tower_equals_its_modules_forward_and_backward():
    torch.manual_seed(0)
    tower = Tower(2 * 8 + 3, [16, 12], 8)
    parts = [torch.randn(5, 8, requires_grad=True), torch.randn(5, 8), torch.randn(5, 3)]
    got, want = tower(parts), reference(tower, parts)
    assert torch.equal(got, want)
    (g_got,) = torch.autograd.grad((got * got[:, :1]).sum(), parts[0])
    (g_want,) = torch.autograd.grad((want * want[:, :1]).sum(), parts[0])
    assert torch.equal(g_got, g_want)


def test_a_zero_output_row_stays_zero_as_with_f_normalize():
    tower = Tower(4, [], 3)
    with torch.no_grad():
        tower.mlp[0].weight.zero_()
        tower.mlp[0].bias.zero_()
    out = tower([torch.randn(2, 4)])
    assert torch.equal(out, torch.zeros(2, 3))
    assert torch.equal(out, reference(tower, [torch.randn(2, 4)]))
