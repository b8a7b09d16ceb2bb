"""A vocabulary that tp does not divide is split unevenly (``torch.chunk``'s chunks) and the user
never sees it: logits, loss and greedy ``generate`` equal one plain transformers process.

The tiny GPT-2 (tied ``lm_head``) has 16383 entries, odd, so at tp=2 rank 0 holds rows
[0, 8192) and rank 1 rows [8192, 16383). The vocabulary is large enough that the solver keeps the
logits sharded through the cross-entropy (three all-reduces of per-row statistics cost less than
gathering 16383 logits per token, see ``test_vocab_parallel_loss.py``), so the vocab-parallel loss
runs on uneven chunks too. Tolerances: fp32 logits and loss atol 1e-5 / rtol 1e-4 (the ranks'
partial sums reorder fp32 additions); greedy tokens exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.dist

VOCAB = 16383
IDS = torch.tensor([[5, 17, 16382, 3, 8191, 8192, 7, 9], [8, 1, 2, 3, 16000, 77, 31, 40]])
LABELS = torch.where(torch.arange(8) < 2, -100, IDS)  # the first two positions are ignored
NEW_TOKENS = 6
ATOL, RTOL = 1e-5, 1e-4


def _uneven_collectives_rank(rank: int, world: int, full: torch.Tensor, grad: torch.Tensor) -> dict:
    from autotp.collectives import Comm, redistribute
    from autotp.placement import R, Shard, chunk_range

    comm = Comm.from_default_group()
    start, stop = chunk_range(full.shape[1], rank, world)
    out = {}
    for grad_partial in (False, True):  # backward: own chunk, or (partial gradient) a padded reduce-scatter
        local = full[:, start:stop].clone().requires_grad_()
        gathered = redistribute(local, Shard(1), R, comm, grad_partial, size=full.shape[1])
        gathered.backward(grad * (rank + 1) if grad_partial else grad)
        out[grad_partial] = (gathered.detach(), local.grad)
    whole = full.clone().requires_grad_()
    chunk = redistribute(whole, R, Shard(1), comm)  # narrow; backward: padded all-gather
    chunk.backward(grad[:, start:stop])
    return {"gather": out, "narrow": chunk.detach(), "narrow_grad": whole.grad}


def test_uneven_collectives_gather_narrow_and_reduce_scatter_by_torch_chunk() -> None:
    """7 columns over 2 ranks (4 + 3): the padded all-gather returns the whole tensor and its
    backward each rank's columns (summed over ranks where the gradient is partial), exactly."""
    g = torch.Generator().manual_seed(0)
    full, grad = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    results = run_ranks(_uneven_collectives_rank, 2, full, grad)
    for rank, r in enumerate(results):
        mine = full.chunk(2, 1)[rank]
        for grad_partial, (gathered, local_grad) in r["gather"].items():
            torch.testing.assert_close(gathered, full, atol=0, rtol=0)
            expected = (grad * 3 if grad_partial else grad).chunk(2, 1)[rank]  # 1x + 2x from the ranks
            torch.testing.assert_close(local_grad, expected, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(r["narrow"], mine, atol=0, rtol=0)
        # the narrow's backward gathers every rank's chunk of the gradient: the whole of it
        torch.testing.assert_close(r["narrow_grad"], grad, atol=0, rtol=0)


def _rank(rank: int, world: int, folder: str, export: str) -> dict:
    from autotp import parallelize_model, save_pretrained
    from autotp.context import meta_of

    # verify=True: the first call also runs the unsharded graph and compares every value, gathered
    model = parallelize_model(folder, tp_size=world, verify=True)
    comm = model.autotp.context.comm
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
        tokens = model.generate(IDS[:1, :4], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    save_pretrained(model, export)  # the uneven shards gathered back into the whole table
    model.train()
    model(input_ids=IDS, labels=LABELS)  # compiles (and verifies) the training graph: not counted
    comm.reset_counts()
    loss = model(input_ids=IDS, labels=LABELS).loss
    loss_counts = dict(comm.counts)
    loss.backward()
    table = model.transformer.wte.weight
    return {
        "logits": logits,
        "loss": float(loss),
        "loss_counts": loss_counts,
        "tokens": tokens[0].tolist(),
        "table_rows": tuple(table.shape),
        "table_placement": str(meta_of(table).placement),
        "table_grad": table.grad.clone(),
        "tied": model.lm_head.weight is table,
    }


def test_gpt2_with_a_vocabulary_tp_does_not_divide_matches_one_process(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    folder = save_tiny(
        "gpt2", tmp_path / "gpt2", seed=0, vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )  # train mode without dropout
    ref = GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.no_grad():
        ref_logits = ref(input_ids=IDS).logits
        ref_tokens = ref.generate(IDS[:1, :4], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    ref_tokens = ref_tokens[0].tolist()
    ref.train()
    ref_loss = ref(input_ids=IDS, labels=LABELS).loss
    ref_loss.backward()

    results = run_ranks(_rank, 2, str(folder), str(tmp_path / "export"))

    assert [r["table_rows"] for r in results] == [(8192, 64), (8191, 64)]  # torch.chunk's chunks
    for r in results:
        assert r["table_placement"] == "S(0)" and r["tied"]
        assert r["logits"].shape == ref_logits.shape == (2, 8, VOCAB)
        torch.testing.assert_close(r["logits"], ref_logits, atol=ATOL, rtol=RTOL)
        assert r["tokens"] == ref_tokens
        assert r["loss"] == pytest.approx(float(ref_loss.detach()), rel=RTOL, abs=ATOL)
        # 2 all-reduces per block, 1 for the embedding, 3 for the vocab-parallel loss (row max,
        # sum-exp, the loss itself); no all-gather: a call with labels returns logits=None
        assert r["loss_counts"] == {"all_reduce": 2 * 2 + 1 + 3}
    exported = GPT2LMHeadModel.from_pretrained(tmp_path / "export")
    torch.testing.assert_close(
        exported.transformer.wte.weight,
        GPT2LMHeadModel.from_pretrained(folder).transformer.wte.weight,
        atol=0,
        rtol=0,
    )
    # the tied table's gradient (embedding and lm_head) is the rank's rows of one process's
    for rank, r in enumerate(results):
        torch.testing.assert_close(
            r["table_grad"], ref.transformer.wte.weight.grad.chunk(2, 0)[rank], atol=ATOL, rtol=RTOL
        )
