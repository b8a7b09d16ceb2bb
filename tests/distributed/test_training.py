"""Training at tp=2 (gloo, CPU): the loss with ignored labels, every gradient, the clipped global
gradient norm and an AdamW loss curve equal one process.

Tolerance: gradients (gathered from the shards) within atol 1e-5 / rtol 1e-4 of one process, and
losses within 1e-5 relative: the row-parallel all-reduces reorder fp32 sums (~1e-6 relative).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.dist

IDS = torch.tensor([[5, 17, 99, 3, 64, 12, 7, 9], [8, 1, 2, 3, 4, 77, 31, 40]])
LABELS = torch.where(torch.arange(8) < 3, -100, IDS)  # the first three positions are ignored


def _gathered_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient as one process would hold it: shards gathered along their dim."""
    import torch.distributed as dist

    from autotp.context import meta_of
    from autotp.placement import Shard

    out = {}
    for name, p in model.named_parameters():
        meta = meta_of(p)
        grad = p.grad.detach().clone()
        if meta is not None and isinstance(meta.placement, Shard):
            parts = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, grad.contiguous())
            grad = torch.cat(parts, meta.placement.dim)
        out[name] = grad
    return out


def _rank_train(rank: int, world: int, folder: str, steps: int) -> dict:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world)
    model.train()
    loss = model(input_ids=IDS, labels=LABELS).loss
    loss.backward()
    grads = _gathered_grads(model)
    from autotp import clip_grad_norm_

    norm = float(clip_grad_norm_(model, max_norm=0.5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    curve = []
    for _ in range(steps):
        optimizer.zero_grad()
        step_loss = model(input_ids=IDS, labels=LABELS).loss
        step_loss.backward()
        optimizer.step()
        curve.append(float(step_loss.detach()))
    return {"loss": float(loss.detach()), "grads": grads, "curve": curve, "norm": norm}


def _reference(folder: Path, steps: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    model.train()
    loss = model(input_ids=IDS, labels=LABELS).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    curve = []
    for _ in range(steps):
        optimizer.zero_grad()
        step_loss = model(input_ids=IDS, labels=LABELS).loss
        step_loss.backward()
        optimizer.step()
        curve.append(float(step_loss.detach()))
    return {"loss": float(loss.detach()), "grads": grads, "curve": curve, "norm": norm}


@pytest.mark.parametrize("layers", [2, 4], ids=["2-layers", "4-layers-through-layer-regions"])
def test_loss_gradients_and_an_adamw_loss_curve_equal_one_process(tmp_path: Path, layers: int) -> None:
    # 4 layers: deep enough for layer regions (autotp/regions.py), so the training graphs trace one
    # layer body and stamp out the others
    folder = save_tiny("llama", tmp_path / "ckpt", seed=0, num_hidden_layers=layers)
    ref = _reference(folder, steps=3)
    for r in run_ranks(_rank_train, 2, str(folder), 3):
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert set(r["grads"]) == set(ref["grads"])
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=name)
        assert r["norm"] == pytest.approx(ref["norm"], rel=1e-5)  # the global norm, not this rank's
        assert r["curve"] == pytest.approx(ref["curve"], rel=1e-5)
        assert r["curve"][-1] < r["curve"][0]  # the optimizer over local shards really trains
