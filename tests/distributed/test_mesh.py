"""A 2x2 device mesh (dp=2 x tp=2, gloo, CPU): tensor parallelism on mesh["tp"], data parallelism
through torch's FSDP2 (``fully_shard``) or DDP on mesh["dp"].

Each dp rank trains on its half of a global batch (every token labelled, so both halves weigh the
same in the whole batch's mean loss); over 3 AdamW steps, each clipped by ``autotp.clip_grad_norm_``,
the dp-mean loss and the gradient norm equal one transformers process training on the whole batch
(rtol 1e-4: the row-parallel all-reduces and the dp averaging reorder fp32 sums, ~1e-6 relative
per step). With FSDP2 each rank holds a quarter of the parameter bytes between steps. The DDP case
trains a model with one kv head (k/v replicated beside split q heads, their partial gradients
reduced over the tp group); gradient subgroups of grouped kv heads under a mesh are checked in
tests/distributed/test_chunk_groups_on_mesh.py.

The layers run through their layer regions (``layer_regions=True``: the path of every model of 4
layers or more, here at 2), under DDP and FSDP2 alike.

Each engine's mesh is launched once (:func:`trained`): the same run saves a checkpoint after its first
step, and after its checks loads it and takes the second step again (then, under DDP, exports the
model): the checkpoint tests read that run. (A launch of its own compiled the same training graphs
again on all 4 ranks.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny, through_regions

pytestmark = pytest.mark.dist

#: the global batch: 4 sequences of 8 tokens; dp rank d trains on rows 2d and 2d+1
IDS = torch.tensor([[5, 17, 99, 3, 64, 12, 7, 9], [8, 1, 2, 3, 4, 77, 31, 40],
                    [11, 42, 6, 90, 23, 2, 14, 71], [3, 3, 120, 56, 8, 19, 100, 1]])
STEPS, LR, MAX_NORM = 3, 1e-2, 0.5
#: the trained model's forward reads the whole batch as one sequence of 32 tokens: every weight the
#: steps moved (each embedding row of the batch's tokens, every matrix) at batch 1, the shape the
#: warm-up compiled (at batch 4 that forward compiled one more graph on each of the 4 ranks)
WHOLE_BATCH_AS_ONE = IDS.reshape(1, -1)


def _param_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameter storage this rank holds (FSDP2's DTensor shards by their local piece,
    and the tp shards FSDP2 gathers into, whose storage is freed outside a call)."""
    from torch.distributed.tensor import DTensor

    from autotp.context import meta_of

    storages: dict[int, int] = {}
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        meta = meta_of(p)
        if meta is not None and meta.local is not None and meta.local.untyped_storage().nbytes():
            storages[meta.local.untyped_storage().data_ptr()] = meta.local.untyped_storage().nbytes()
    return sum(storages.values())


def _rank_train(rank: int, world: int, folder: str, kind: str, ckpt: str, export: str | None) -> dict:
    """``kind`` (DDP or FSDP2) on the 2x2 mesh: :data:`STEPS` clipped AdamW steps, saving a checkpoint
    after the first; the trained model's forward and greedy tokens; then the checkpoint loaded (back
    to after the first step) and the second step taken again, and given ``export``, the model (now
    two steps trained) written there by ``save_pretrained``."""
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autotp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = autotp.parallelize_model(folder, mesh=mesh, data_parallel=kind, layer_regions=True)
    model.train()
    dp_rank = mesh.get_local_rank("dp")
    ids = IDS[2 * dp_rank: 2 * dp_rank + 2]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step() -> tuple[torch.Tensor, float]:
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = float(autotp.clip_grad_norm_(model, max_norm=MAX_NORM))
        optimizer.step()
        return loss.detach().clone(), norm

    curve, norms, losses = [], [], []
    for i in range(STEPS):
        loss, norm = step()
        if i == 0:
            autotp.save_checkpoint(model, ckpt, optimizer)
        norms.append(norm)
        losses.append(float(loss))  # this dp rank's half of the batch
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # the dp-mean loss
        curve.append(float(loss) / 2)
    held = _param_bytes(model)
    model.eval()  # the trained model serves: a forward on the whole batch, and greedy generation
    with torch.no_grad():
        logits = model(input_ids=WHOLE_BATCH_AS_ONE).logits
        tokens = model.generate(IDS[:1], max_new_tokens=3, do_sample=False)
    model.train()
    autotp.load_checkpoint(model, ckpt, optimizer)  # back to after the first step
    again = float(step()[0])
    if export is not None:
        autotp.save_pretrained(model, export)  # two steps, gathered over tp, written once
    saved_at = json.loads((Path(ckpt) / "autotp_checkpoint.json").read_text())["saved_at"]
    return {"curve": curve, "norms": norms, "bytes": held, "logits": logits, "tokens": tokens,
            "tp_rank": mesh.get_local_rank("tp"), "dp_rank": dp_rank, "plan": model.autotp.plan,
            "second": losses[1], "again": again, "saved_at": saved_at, "regional": through_regions(model)}


def _reference(folder: Path) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    curve, norms = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)))
        optimizer.step()
        curve.append(float(loss.detach()))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=WHOLE_BATCH_AS_ONE).logits
        tokens = model.generate(IDS[:1], max_new_tokens=3, do_sample=False)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    small = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 1)
    return {"curve": curve, "norms": norms, "bytes": total, "small_bytes": small, "logits": logits,
            "tokens": tokens}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = save_tiny("llama", tmp_path_factory.mktemp("mesh") / "llama", seed=0)
    return folder, _reference(folder)


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The tiny Llama with one kv head: at tp=2 both tp ranks hold k/v whole beside their share of
    the q heads, so each rank's k/v gradient is a partial sum the plan reduces over the tp group."""
    folder = save_tiny("llama", tmp_path_factory.mktemp("mesh") / "kv1", seed=0, num_key_value_heads=1)
    return folder, _reference(folder)


#: engine -> the model it trains: DDP the one-kv-head model (replicated k/v, split q heads), FSDP2 the
#: 4-kv-head one
MODEL_OF = {"ddp": "one_kv_head", "fsdp": "tiny"}


@pytest.fixture(scope="module")
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Trained]:
    """``trained(kind)`` -> :class:`Trained`: :func:`_rank_train` of ``kind``'s model on the 2x2
    mesh, launched once per module (the DDP run exports its model)."""
    runs: dict[str, Trained] = {}

    def run(kind: str) -> Trained:
        if kind not in runs:
            folder, ref = request.getfixturevalue(MODEL_OF[kind])
            root = tmp_path_factory.mktemp(f"{kind}-run")
            export = root / "export" if kind == "ddp" else None
            results = run_ranks(_rank_train, 4, str(folder), kind, str(root / "ckpt"),
                                None if export is None else str(export))
            runs[kind] = Trained(folder, ref, root / "ckpt", export, results)
        return runs[kind]

    return run


@dataclass(frozen=True)
class Trained:
    """A :func:`_rank_train` launch: its checkpoint folder, one process's reference, the checkpoint
    saved after the first step, the export (DDP) and the ranks' results."""

    folder: Path
    ref: dict
    ckpt: Path
    export: Path | None
    results: list[dict]


@pytest.mark.parametrize("kind, model", list(MODEL_OF.items()))
def test_a_2x2_mesh_trains_like_one_process_on_the_whole_batch(trained, kind: str, model: str) -> None:
    run = trained(kind)
    ref, results = run.ref, run.results
    assert sorted((r["dp_rank"], r["tp_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        assert r["regional"] and all(r["regional"])  # each layer through its region (layer_regions=True)
        assert r["curve"] == pytest.approx(ref["curve"], rel=1e-4)
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-4)  # global over dp and tp
        assert r["norms"][0] > MAX_NORM  # the clipping really scaled the gradients
        # the trained weights serve like one process's (atol 1e-3: AdamW moves a weight whose
        # gradient is near 0 by ~lr x sign, which amplifies fp32 reordering to ~1e-4 per weight)
        torch.testing.assert_close(r["logits"], ref["logits"], atol=1e-3, rtol=1e-3)
        assert torch.equal(r["tokens"], ref["tokens"])
    assert ref["curve"][-1] < ref["curve"][0]
    for r in results:  # one kv head: every tp rank holds k/v whole, its q heads split
        styles = {name.split(".")[-2]: entry["style"] for name, entry in r["plan"]["parameters"].items()
                  if ".layers.0.self_attn." in name}
        assert styles["q_proj"] == "colwise" and styles["o_proj"] == "rowwise"
        assert styles["k_proj"] == styles["v_proj"] == ("replicate" if model == "one_kv_head" else "colwise")
    if kind == "fsdp":  # a quarter of the parameters per rank (+ a share of the small 1-D ones)
        for r in results:
            assert r["bytes"] <= ref["bytes"] / 4 + ref["small_bytes"] / 2, (r["bytes"], ref["bytes"])
    else:  # DDP keeps each tp rank's whole shard on every dp rank: about half
        for r in results:
            assert r["bytes"] >= ref["bytes"] / 2 - ref["small_bytes"]


def _bad_inputs(rank: int, world: int, folder: str, odd_folder: str) -> dict[str, str]:
    """Each bad mesh or data-parallel argument, on 2 ranks; returns the AutoTPError messages. Any
    checkpoint read before the refusal fails the case instead."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import autotp
    import autotp.api

    def no_reads(*args: object, **kwargs: object) -> None:
        raise AssertionError("a checkpoint was opened before the mesh was checked")

    autotp.api.Checkpoint = no_reads
    cases = {
        "unnamed dims": lambda: autotp.parallelize_model(folder, mesh=init_device_mesh("cpu", (1, 2))),
        "other names": lambda: autotp.parallelize_model(
            folder, mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("replica", "shard"))),
        "dp x tp != world": lambda: autotp.parallelize_model(
            folder, mesh=DeviceMesh("cpu", torch.tensor([[0]]), mesh_dim_names=("dp", "tp"))),
        "tp does not divide": lambda: autotp.parallelize_model(
            odd_folder, mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))),
        "unknown engine": lambda: autotp.parallelize_model(
            folder, mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp")), data_parallel="zero3"),
        "engine without dp dim": lambda: autotp.parallelize_model(
            folder, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), data_parallel="ddp"),
        "tp_size disagrees": lambda: autotp.parallelize_model(
            folder, tp_size=1, mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))),
    }
    messages = {}
    for name, call in cases.items():
        try:
            call()
            messages[name] = "no error"
        except autotp.AutoTPError as e:
            messages[name] = str(e)
    return messages


def test_bad_meshes_and_engines_are_refused_before_any_weight_is_read(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "llama", seed=0)
    odd = save_tiny("llama", tmp_path / "odd", seed=0, intermediate_size=127)  # 127 does not split in 2
    for m in run_ranks(_bad_inputs, 2, str(folder), str(odd)):
        assert "named (\"dp\", \"tp\")" in m["unnamed dims"] and "init_device_mesh" in m["unnamed dims"]
        assert "('replica', 'shard')" in m["other names"]
        assert "dp=1 x tp=1 = 1 ranks but the world has 2" in m["dp x tp != world"]
        assert "intermediate_size=127" in m["tp does not divide"]
        assert "Valid tp sizes for this model: [1]" in m["tp does not divide"]
        assert "'zero3'" in m["unknown engine"] and "['fsdp', 'ddp']" in m["unknown engine"]
        assert "needs a \"dp\" dim" in m["engine without dp dim"]
        assert "disagrees with the mesh's \"tp\" dim (2)" in m["tp_size disagrees"]


def _rank_compile_on_mesh(rank: int, world: int, folder: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from autotp.context import meta_of

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = IDS[mesh.get_local_rank("dp"): mesh.get_local_rank("dp") + 1]  # each replica its own row
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        out = torch.compile(model, backend="autotp", options={"mesh": mesh})(input_ids=ids, use_cache=False).logits
    q = meta_of(model.model.layers[0].self_attn.q_proj.weight)
    return {"err": (out - ref).abs().max().item(), "ref_max": ref.abs().max().item(),
            "q_local": tuple(q.local.shape), "q_global": tuple(q.global_shape)}


def test_torch_compile_with_a_mesh_runs_tensor_parallel_on_its_tp_dim(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "llama", seed=0)
    for r in run_ranks(_rank_compile_on_mesh, 4, str(folder)):
        assert r["err"] <= 1e-5 + 1e-4 * r["ref_max"]  # equal to the uncompiled model on the replica's row
        assert r["q_local"] == (r["q_global"][0] // 2, r["q_global"][1])  # split over tp=2, not the 4 ranks


def _rank_resume_whole_batch(rank: int, world: int, folder: str, ckpt: str) -> float:
    import autotp

    model = autotp.parallelize_model(folder, tp_size=world)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    autotp.load_checkpoint(model, ckpt, optimizer)
    optimizer.zero_grad()
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _assert_resumes_on_its_mesh_and_at_tp2(run: Trained) -> None:
    """The checkpoint saved after the first step: loaded on its mesh, the second step is the same
    step; saved at dp=2 x tp=2, resumed at tp=2 without data parallelism on the whole batch, its step
    is the mean of the dp replicas' second steps (equal token counts), within rtol 1e-4 (another
    reduction order)."""
    for r in run.results:
        assert r["again"] == pytest.approx(r["second"], rel=1e-6)  # the resumed step is the same step
    (saved_at,) = {tuple(r["saved_at"].items()) for r in run.results}
    assert dict(saved_at) == {"tp": 2, "dp": 2}
    dp_mean = sum(r["second"] for r in run.results) / len(run.results)
    for loss in run_ranks(_rank_resume_whole_batch, 2, str(run.folder), str(run.ckpt)):
        assert loss == pytest.approx(dp_mean, rel=1e-4)


def test_checkpoints_on_a_ddp_mesh_resume_and_export_what_one_process_trains(trained) -> None:
    """The DDP run (one kv head) resumes its checkpoint, and its export after the second step again
    is what one process trains in two clipped steps on the whole batch."""
    from transformers import AutoModelForCausalLM

    run = trained("ddp")
    _assert_resumes_on_its_mesh_and_at_tp2(run)
    reference = AutoModelForCausalLM.from_pretrained(run.folder)
    reference.train()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    for _ in range(2):  # what the mesh trained: two clipped steps on the whole batch
        optimizer.zero_grad()
        reference(input_ids=IDS, labels=IDS).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=MAX_NORM)
        optimizer.step()
    exported_model = AutoModelForCausalLM.from_pretrained(run.export)
    with torch.no_grad():  # the export is the trained model: its loss on the whole batch is one process's
        assert float(exported_model(input_ids=IDS, labels=IDS).loss) == pytest.approx(
            float(reference(input_ids=IDS, labels=IDS).loss), rel=1e-4)
    # weights within 5e-4 (lr / 20): AdamW's first steps move a weight by about lr x sign(gradient),
    # so an element whose gradient is near 0 amplifies the fp32 reordering of its sum (seen: 1.2e-4)
    exported = dict(exported_model.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(exported[name], p.detach(), atol=5e-4, rtol=1e-4, msg=name)


def test_an_fsdp2_checkpoint_resumes_on_its_mesh_and_at_tp2_without_data_parallelism(trained) -> None:
    """Each FSDP2 tensor is gathered over dp and tp into the one-process layout; a load keeps each
    rank's dp chunk of its tp piece."""
    _assert_resumes_on_its_mesh_and_at_tp2(trained("fsdp"))
