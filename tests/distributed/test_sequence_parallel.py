"""Sequence parallelism at tp=2 (gloo, CPU): ``parallelize_model(..., sequence_parallel=True)``
keeps the residual stream and the norms on sequence shards between the tensor-parallel regions.
Each all-reduce of a block becomes a reduce-scatter (into sequence shards) and an all-gather
(before the next column-parallel matmul), the loss and every gradient equal one process, and the
activations autograd saves for backward take fewer bytes per rank than without it: each
column-parallel matmul saves its input's sequence shard and gathers it again in backward, as
Megatron-LM does (``autotp/passes/save_shards.py``). The layers run through their layer regions
(``layer_regions=True``: the path of every model of 4 layers or more, here at 2).

Tolerance: as ``test_training.py`` (gradients atol 1e-5 / rtol 1e-4, loss 1e-5 relative: the
reductions reorder fp32 sums).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny, through_regions
from tests.distributed.test_training import IDS, LABELS, _gathered_grads

pytestmark = pytest.mark.dist

LAYERS = 2


def _rank(rank: int, world: int, folder: str, sequence_parallel: bool) -> dict:
    from autotp import parallelize_model
    from autotp.training import saved_activation_bytes

    model = parallelize_model(folder, tp_size=world, sequence_parallel=sequence_parallel, layer_regions=True)
    model.train()
    model(input_ids=IDS, labels=LABELS).loss.backward()  # compiles the training graphs
    model.zero_grad()
    comm = model.autotp.context.comm
    comm.reset_counts()
    loss, saved = saved_activation_bytes(lambda: model(input_ids=IDS, labels=LABELS).loss)
    loss.backward()
    return {"loss": float(loss.detach()), "saved_bytes": saved, "grads": _gathered_grads(model),
            "forward": dict(comm.counts), "backward": dict(comm.backward_counts), "regional": through_regions(model)}


def test_sequence_parallel_trades_each_all_reduce_for_a_reduce_scatter_and_an_all_gather(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny("llama", tmp_path / "ckpt", seed=0, num_hidden_layers=LAYERS)
    from autotp.training import saved_activation_bytes

    ref = AutoModelForCausalLM.from_pretrained(folder)
    ref.train()
    ref_loss, ref_saved = saved_activation_bytes(lambda: ref(input_ids=IDS, labels=LABELS).loss)
    ref_loss.backward()
    ref_loss = float(ref_loss.detach())
    plain = run_ranks(_rank, 2, str(folder), False)
    sequence = run_ranks(_rank, 2, str(folder), True)
    for r in plain + sequence:
        assert r["regional"] and all(r["regional"])  # each layer through its region (layer_regions=True)
    for r in sequence:
        assert r["loss"] == pytest.approx(ref_loss, rel=1e-5)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    for p, s in zip(plain, sequence, strict=True):
        assert "reduce_scatter" not in p["forward"]
        # the embedding's and each block's two all-reduces become reduce-scatters into sequence
        # shards, and each block's two column-parallel inputs are all-gathered back
        assert s["forward"]["reduce_scatter"] == 2 * LAYERS + 1
        assert s["forward"]["all_gather"] == p["forward"]["all_gather"] + 2 * LAYERS
        assert s["saved_bytes"] < p["saved_bytes"]  # norms and residuals are saved as 1/2 shards
        # ... and so are the inputs of the column-parallel matmuls (q, k, v, gate, up, lm_head):
        # measured 246532 of one process's 490820 bytes (0.502); 256772 (0.523) when they were
        # saved gathered
        assert s["saved_bytes"] <= 0.51 * ref_saved
        # each of those 5 matmuls per block and lm_head all-gathers its input again in backward, on
        # top of the reduce-scatters' conjugate all-gathers
        assert s["backward"]["all_gather"] == s["forward"]["reduce_scatter"] + 5 * LAYERS + 1
