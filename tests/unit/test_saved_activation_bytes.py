"""``autotp.training.saved_activation_bytes`` counts the storages autograd saves for backward, and
with ``weights`` leaves out the storages of the weights a matmul keeps for its input's gradient.

A bias-free linear layer on a [4, 32] input that requires grad saves exactly two storages: the input
(for the weight's gradient, 4 x 32 fp32) and the weight (for the input's gradient, 16 x 32 fp32).
"""

from __future__ import annotations

import torch

from autotp.training import saved_activation_bytes


def _linear_and_input() -> tuple[torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(32, 16, bias=False), torch.randn(4, 32, requires_grad=True)


def test_every_saved_storage_is_counted_once() -> None:
    linear, x = _linear_and_input()
    loss, saved = saved_activation_bytes(lambda: linear(x).sum())
    loss.backward()
    assert saved == (4 * 32 + 16 * 32) * 4


def test_the_weights_named_are_left_out_and_backward_still_runs() -> None:
    linear, x = _linear_and_input()
    loss, saved = saved_activation_bytes(lambda: linear(x).sum(), weights=lambda: [linear.weight])
    loss.backward()
    assert saved == 4 * 32 * 4
    torch.testing.assert_close(x.grad, linear.weight.sum(0).expand(4, 32), atol=1e-6, rtol=1e-5)
