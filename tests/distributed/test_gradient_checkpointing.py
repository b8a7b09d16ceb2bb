"""Gradient checkpointing on a parallelized model (tp=2, gloo): transformers'
``gradient_checkpointing_enable()`` and ``torch.utils.checkpoint`` in user code train with the loss
and gradients of one process, and autograd saves fewer activation bytes than without it.

Each checkpointed block reaches the backend as one higher-order op; autotp plans through its body
and recomputes the block, collectives included, in backward (``autotp/passes/checkpoint.py``).
Tolerance: loss within 1e-5 relative, gradients (gathered from the shards) within atol 1e-5 /
rtol 1e-4 of one process (the row-parallel all-reduces reorder fp32 sums).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny
from tests.distributed.test_training import LABELS, _gathered_grads

pytestmark = pytest.mark.dist

IDS = torch.tensor([[5, 17, 99, 3, 64, 12, 7, 9], [8, 1, 2, 3, 4, 77, 31, 40]])


def _rank_train(rank: int, world: int, folder: str) -> dict:
    from torch._dynamo.utils import counters

    import autotp
    from autotp.training import saved_activation_bytes

    out = {}
    for checkpointing in (False, True):
        model = autotp.parallelize_model(folder, tp_size=world, trace_once=True)
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        loss, saved = saved_activation_bytes(lambda m=model: m(input_ids=IDS, labels=LABELS).loss)
        loss.backward()
        out[checkpointing] = {"loss": float(loss.detach()), "saved": saved, "grads": _gathered_grads(model)}
    out["traced"] = counters["frames"]["ok"]
    return out


class _Blocks(torch.nn.Module):
    """Two MLP blocks, each checkpointed in user code (``torch.utils.checkpoint``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x.pow(2).mean()


def _rank_user_checkpoint(rank: int, world: int) -> dict:
    from autotp.context import meta_of

    torch.manual_seed(0)
    model = _Blocks()
    x = torch.randn(4, 8, 32)
    reference = _Blocks()
    reference.load_state_dict(model.state_dict())
    ref_loss = reference(x)
    ref_loss.backward()
    loss = torch.compile(model, backend="autotp")(x)
    loss.backward()
    grads, placements = {}, {}
    for name, p in model.named_parameters():
        meta = meta_of(p)
        local = meta.local
        grad = local.grad
        placements[name] = str(meta.placement)
        if grad.shape != p.shape:  # a shard: gathered along its dim
            import torch.distributed as dist

            parts = [torch.empty_like(grad) for _ in range(world)]
            dist.all_gather(parts, grad.contiguous())
            grad = torch.cat(parts, meta.placement.dim)
        grads[name] = (grad, dict(reference.named_parameters())[name].grad)
    return {"loss": float(loss), "ref": float(ref_loss), "grads": grads, "placements": placements}


def test_gradient_checkpointing_trains_like_one_process_and_saves_fewer_activations(tmp_path: Path) -> None:
    """With the ranks sharing frames (``trace_once=True``: the last rank traces, rank 0 installs
    its frames), also through the graph break of transformers' checkpointing warning and the
    resume functions after it, which have free variables (rank 0 once hung there: installing
    such a function ran a frame of autotp's code on rank 0 only, which took the tracer's next
    frame as its own; now such a divergence raises at the tracer's next frame). Two models of one
    folder in one process, checkpointing off then on."""
    from transformers import AutoModelForCausalLM

    from autotp.training import saved_activation_bytes

    folder = save_tiny("llama", tmp_path / "llama", seed=0, num_hidden_layers=4)
    reference = AutoModelForCausalLM.from_pretrained(folder)
    reference.train()
    ref_loss, ref_saved = saved_activation_bytes(lambda: reference(input_ids=IDS, labels=LABELS).loss)
    ref_loss.backward()
    ranks = run_ranks(_rank_train, 2, str(folder), timeout=300)
    # the last rank traced, rank 0 installed its frames (all of them, or up to one that did not install here,
    # from which on each rank traced its own: the install reads a guard's pickled transformers registry)
    assert ranks[0]["traced"] < ranks[1]["traced"]
    for r in ranks:
        for checkpointing in (False, True):
            got = r[checkpointing]
            assert got["loss"] == pytest.approx(float(ref_loss.detach()), rel=1e-5)
            for name, p in reference.named_parameters():
                torch.testing.assert_close(got["grads"][name], p.grad, atol=1e-5, rtol=1e-4,
                                           msg=lambda m, n=name, c=checkpointing: f"{n} (checkpointing={c}): {m}")
        print("saved bytes per rank: one process", ref_saved, "tp=2", r[False]["saved"], "tp=2 + checkpointing",
              r[True]["saved"])
        assert r[True]["saved"] < 0.8 * r[False]["saved"]  # the blocks' activations are recomputed, not saved


def test_torch_utils_checkpoint_in_user_code_is_planned_through(tmp_path: Path) -> None:
    for r in run_ranks(_rank_user_checkpoint, 2):
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-5)
        assert any(p.startswith("S(") for p in r["placements"].values())  # the blocks really are sharded
        for name, (grad, ref) in r["grads"].items():
            torch.testing.assert_close(grad, ref, atol=1e-5, rtol=1e-4, msg=name)
