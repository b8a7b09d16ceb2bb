"""``autotp plan --tp-plan`` exports a plan transformers' own tensor parallelism loads.

A tiny seeded Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``) is planned by autotp in one process
(:func:`autotp.planner.plan_model`, meta device), its ``tp_plan`` is handed to transformers as
``DistributedConfig(tp_plan=...)`` on 2 gloo ranks, and the logits are compared with one plain
transformers process. Phi-3's fused gate | up is stored strided (rank r holds its chunk of the gate
half and of the up half) and exports as transformers' ``packed_colwise``; plain ``colwise`` would
give rank 0 the whole gate half and rank 1 the whole up half. Its q | k | v (three segments, of
unequal sizes under GQA) has no transformers spelling, so the free plan's export is refused, and
this test plans with ``qkv_proj`` replicated (autotp then gathers ``o_proj``'s column-parallel output,
``colwise_gather_output``; with ``o_proj`` pinned row-parallel it slices the replicated input,
``rowwise_split_input``).

Mixtral's stacked experts are keyed by parameter name, as transformers' own MoE plans are: gate | up
(``(E, 2I, H)``, strided over its two halves) as ``packed_colwise``, down (``(E, H, I)``, split on I)
as ``rowwise``; the all-reduce after the experts is the model's own ``moe_tp_experts`` rule, which
``DistributedConfig`` keeps.

Tolerance: atol 1e-5, rtol 1e-4 (fp32; row-parallel matmuls sum partial results across ranks, which
reorders fp32 additions), as in tests/distributed/test_parallelize.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny, tiny_plan

pytestmark = pytest.mark.dist

PAD_ID = 120
PROMPT = [[5, 17, 99, 3, 64, 12, 7]]
ATOL, RTOL = 1e-5, 1e-4
QKV = "model.layers.*.self_attn.qkv_proj"
O_PROJ = "model.layers.*.self_attn.o_proj"
#: autotp's choice for o_proj once q | k | v is kept whole (column-parallel, output gathered), and
#: o_proj pinned row-parallel: its input (the replicated attention output) is sliced on each rank
O_PROJ_CASES = {
    "gathered": ({QKV: "replicate"}, "colwise_gather_output"),
    "split_input": ({QKV: "replicate", O_PROJ: "rowwise"}, "rowwise_split_input"),
}


def _transformers_rank(rank: int, world: int, folder: str, tp_plan: dict[str, str]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from transformers import DistributedConfig, Phi3ForCausalLM

    model = Phi3ForCausalLM.from_pretrained(
        folder, distributed_config=DistributedConfig(tp_plan=tp_plan, tp_size=world)).eval()
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT)).logits
    local = gate_up.to_local() if isinstance(gate_up, DTensor) else gate_up
    return {"logits": logits.detach().clone(), "gate_up": local.detach().clone()}


@pytest.mark.parametrize("case", sorted(O_PROJ_CASES))
def test_an_exported_phi3_plan_loads_in_transformers_and_matches_one_process(tmp_path: Path, case: str) -> None:
    from transformers import Phi3ForCausalLM

    world = 2
    overrides, o_proj = O_PROJ_CASES[case]
    report = tiny_plan("phi3", world, overrides=overrides, pad_token_id=PAD_ID)
    plan = report.transformers_tp_plan()
    assert plan == {
        "lm_head": "colwise_gather_output",
        "model.embed_tokens": "embedding_rowwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "model.layers.*.mlp.gate_up_proj": "packed_colwise",
        O_PROJ: o_proj,
        QKV: "replicate",  # else Phi-3's own rule would stay
    }
    folder = save_tiny("phi3", tmp_path / "phi3", pad_token_id=PAD_ID)
    reference = Phi3ForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(PROMPT)).logits
    full = reference.model.layers[0].mlp.gate_up_proj.weight.detach()  # (gate 128 | up 128, 64)
    for rank, r in enumerate(run_ranks(_transformers_rank, world, str(folder), plan)):
        # each rank holds its 64 rows of the gate half and its 64 rows of the up half
        torch.testing.assert_close(r["gate_up"], torch.cat([full[64 * rank:64 * (rank + 1)],
                                                            full[128 + 64 * rank:128 + 64 * (rank + 1)]]),
                                   atol=0, rtol=0)
        torch.testing.assert_close(r["logits"], expected, atol=ATOL, rtol=RTOL)


def _transformers_moe_rank(rank: int, world: int, folder: str, tp_plan: dict[str, str]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from transformers import DistributedConfig, MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(
        folder, distributed_config=DistributedConfig(tp_plan=tp_plan, tp_size=world)).eval()
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT)).logits
    local = gate_up.to_local() if isinstance(gate_up, DTensor) else gate_up
    return {"logits": logits.detach().clone(), "gate_up": local.detach().clone()}


def test_an_exported_mixtral_plan_loads_in_transformers_and_matches_one_process(tmp_path: Path) -> None:
    from transformers import MixtralForCausalLM

    world = 2
    plan = tiny_plan("mixtral", world, pad_token_id=PAD_ID).transformers_tp_plan()
    assert plan["model.layers.*.mlp.experts.gate_up_proj"] == "packed_colwise"
    assert plan["model.layers.*.mlp.experts.down_proj"] == "rowwise"
    folder = save_tiny("mixtral", tmp_path / "mixtral", pad_token_id=PAD_ID)
    reference = MixtralForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(PROMPT)).logits
    full = reference.model.layers[0].mlp.experts.gate_up_proj.detach()  # (4 experts, gate 128 | up 128, 64)
    for rank, r in enumerate(run_ranks(_transformers_moe_rank, world, str(folder), plan)):
        rows = torch.cat([full[:, 64 * rank:64 * (rank + 1)], full[:, 128 + 64 * rank:128 + 64 * (rank + 1)]], 1)
        torch.testing.assert_close(r["gate_up"], rows, atol=0, rtol=0)  # every expert's rows of both halves
        torch.testing.assert_close(r["logits"], expected, atol=ATOL, rtol=RTOL)
