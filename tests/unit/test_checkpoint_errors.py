"""Bad checkpoints and bad arguments fail in parallelize_model with an AutoTPError naming the cause
and the fix, before any compilation; nothing is written into the user's folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import autotp.api
from autotp import parallelize_model
from autotp.api import check_divisible
from autotp.errors import AutoTPError, CheckpointError
from tests._tiny import save_tiny, tiny_config


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def _edit_config(folder: Path, **fields: object) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def test_a_tensor_missing_from_the_checkpoint_is_named(tmp_path, llama_dir):
    folder = _copy(llama_dir, tmp_path / "ck")
    tensors = load_file(os.fspath(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, os.fspath(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"1 parameters have no tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        parallelize_model(folder, progress=False)


def test_a_shape_that_disagrees_with_the_config_names_both_shapes(tmp_path, llama_dir):
    folder = _copy(llama_dir, tmp_path / "ck")
    _edit_config(folder, intermediate_size=192)
    with pytest.raises(CheckpointError, match=r"has shape \(128, 64\) but the model built from config\.json "
                                              r"expects \(192, 64\)"):
        parallelize_model(folder, progress=False)


def _never_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compile(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.compile was reached before the checkpoint was checked")

    monkeypatch.setattr(autotp.api.torch, "compile", no_compile)


def test_every_checkpoint_problem_is_named_at_once_before_anything_is_compiled(tmp_path, llama_dir, monkeypatch):
    folder = _copy(llama_dir, tmp_path / "ck")
    tensors = load_file(os.fspath(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"][:, :100].contiguous()
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.ones(64, 64, dtype=torch.int8)  # quantized?
    save_file(tensors, os.fspath(folder / "model.safetensors"), metadata={"format": "pt"})
    _never_compiled(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        parallelize_model(folder, progress=False)
    message = str(err.value)
    assert "1 parameters have no tensor" in message and "model.layers.1.mlp.up_proj.weight" in message
    assert ("model.layers.0.mlp.down_proj.weight has shape (64, 100) but the model built from config.json "
            "expects (64, 128)") in message
    assert "model.layers.0.self_attn.q_proj.weight is stored as torch.int8 but" in message


def test_a_float8_checkpoint_tensor_is_convertible_but_an_integer_one_is_not() -> None:
    from autotp.checkpoint_match import convertible

    assert convertible(torch.float8_e4m3fn, torch.bfloat16) and convertible(torch.bfloat16, torch.float32)
    assert not convertible(torch.int8, torch.float32) and not convertible(torch.complex64, torch.float32)
    assert not convertible(torch.bool, torch.float16)


def test_a_truncated_safetensors_file_is_named_with_the_fix(tmp_path, llama_dir):
    folder = _copy(llama_dir, tmp_path / "ck")
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors is not a readable safetensors file "
                                              rf"\('model\.norm\.weight' ends at byte {size} but the file has "
                                              rf"{size - 100}\).*force-download"):
        parallelize_model(folder, progress=False)


def test_a_corrupt_safetensors_header_is_named(tmp_path, llama_dir):
    folder = _copy(llama_dir, tmp_path / "ck")
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[8:20] = b"not json at "
    (folder / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="header is not JSON"):
        parallelize_model(folder, progress=False)


def test_an_unknown_architecture_class_is_named_with_close_matches(tmp_path, llama_dir):
    folder = _copy(llama_dir, tmp_path / "ck")
    _edit_config(folder, architectures=["LlamaForCausalLMX"])
    with pytest.raises(AutoTPError, match=r"no architecture 'LlamaForCausalLMX'.*LlamaForCausalLM"):
        parallelize_model(folder, progress=False)


def test_an_unknown_model_type_says_to_upgrade_transformers(tmp_path, llama_dir):
    folder = _copy(llama_dir, tmp_path / "ck")
    _edit_config(folder, model_type="llama_from_the_future")
    with pytest.raises(AutoTPError, match=r"(?s)model_type 'llama_from_the_future'.*upgrade transformers"):
        parallelize_model(folder, progress=False)


def test_remote_code_is_refused_without_trust_remote_code(tmp_path, llama_dir):
    folder = _copy(llama_dir, tmp_path / "ck")
    _edit_config(folder, architectures=["MyLlamaForCausalLM"],
                 auto_map={"AutoModelForCausalLM": "modeling_my.MyLlamaForCausalLM"})
    with pytest.raises(AutoTPError, match=r"remote code.*\['AutoModelForCausalLM'\].*trust_remote_code=True"):
        parallelize_model(folder, progress=False)


def test_a_remote_config_class_is_refused_without_trust_remote_code(tmp_path, llama_dir):
    folder = _copy(llama_dir, tmp_path / "ck")
    _edit_config(folder, model_type="my_llama", auto_map={"AutoConfig": "configuration_my.MyConfig"})
    with pytest.raises(AutoTPError, match=r"needs custom code.*trust_remote_code=True"):
        parallelize_model(folder, progress=False)


@pytest.mark.parametrize(
    ("sizes", "tp", "named", "valid"),
    [
        # 6 heads split in whole heads over 4 ranks (2 + 2 + 1 + 1), not over 8 (a rank without a head)
        (dict(num_attention_heads=6, num_key_value_heads=6, hidden_size=48), 8, ["num_attention_heads=6"], [1, 2, 4]),
        (dict(num_key_value_heads=3, num_attention_heads=6, hidden_size=48, intermediate_size=96), 2, ["num_key_value_heads=3"], [1, 3, 6]),
        (dict(num_key_value_heads=4), 16, ["num_attention_heads=8"], [1, 2, 4, 8]),
        (dict(num_key_value_heads=8, intermediate_size=100), 8, ["intermediate_size=100"], [1, 2, 4]),
    ],
)
def test_split_sizes_that_do_not_divide_list_the_valid_tp_sizes(sizes, tp, named, valid):
    """Heads, hidden and intermediate sizes divide by tp; kv heads divide by it or divide it."""
    with pytest.raises(AutoTPError) as err:
        check_divisible(tiny_config("llama", **sizes), tp)
    for field in named:
        assert field in str(err.value)
    assert f"Valid tp sizes for this model: {valid}." in str(err.value)


@pytest.mark.parametrize(("kv_heads", "tp"), [(2, 4), (1, 2), (1, 8), (4, 8)])
def test_kv_heads_that_divide_tp_are_accepted(kv_heads, tp):
    check_divisible(tiny_config("llama", num_key_value_heads=kv_heads), tp)  # no error: grouped kv heads


def test_a_timeout_must_be_a_positive_number_of_seconds(llama_dir):
    with pytest.raises(AutoTPError, match="timeout must be a positive number of seconds, got -1"):
        parallelize_model(llama_dir, timeout=-1)


def test_the_ci_variable_turns_progress_bars_off_at_the_entry_point(llama_dir, monkeypatch):
    seen: list[bool] = []

    def recording(*args, progress, **kwargs):
        seen.append(progress)
        raise CheckpointError("stop here")

    monkeypatch.setattr(autotp.api, "resolve_checkpoint", recording)
    monkeypatch.setenv("CI", "1")
    with pytest.raises(CheckpointError):
        parallelize_model(llama_dir)
    monkeypatch.delenv("CI")
    with pytest.raises(CheckpointError):
        parallelize_model(llama_dir)
    with pytest.raises(CheckpointError):
        parallelize_model(llama_dir, progress=False)
    assert seen == [False, True, False]


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    out = {".": (0, folder.stat().st_mtime_ns)}
    for p in sorted(folder.rglob("*")):
        st = p.stat()
        out[p.relative_to(folder).as_posix()] = (st.st_size, st.st_mtime_ns)
    return out


def test_loading_and_running_writes_nothing_into_the_users_folder(tmp_path):
    folder = save_tiny("llama", tmp_path / "ck", shards=2, dtype=torch.bfloat16)
    before = _listing(folder)
    model = parallelize_model(folder, dtype="fp32", progress=False)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert _listing(folder) == before


def test_an_unknown_model_type_is_one_whole_sentence_with_the_fix(tmp_path, llama_dir):
    folder = _copy(llama_dir, tmp_path / "ck")
    _edit_config(folder, model_type="llama_from_the_future")
    with pytest.raises(AutoTPError) as err:
        parallelize_model(folder, progress=False)
    message = str(err.value)
    assert "has model_type 'llama_from_the_future', which transformers" in message
    assert message.endswith("or fix model_type in config.json.") and "\n" not in message


def test_a_quoted_third_party_reason_is_cut_between_words_only() -> None:
    from autotp.hf_config import short_reason

    assert short_reason("First sentence. Second one.") == "First sentence."
    long = "word " * 100
    cut = short_reason(long, limit=50)
    assert cut.endswith(" ...") and all(w == "word" for w in cut[:-4].split())


def test_a_folder_without_weights_points_to_the_planner_not_to_a_private_option(tmp_path):
    folder = tmp_path / "config-only"
    tiny_config("llama").save_pretrained(folder)
    with pytest.raises(CheckpointError) as err:
        parallelize_model(folder, progress=False)
    assert "require_weights" not in str(err.value) and f"autotp plan {folder.resolve()} --tp N" in str(err.value)


def test_the_planner_checks_weights_it_is_given_before_tracing(tmp_path, llama_dir, monkeypatch):
    import autotp.planner

    folder = _copy(llama_dir, tmp_path / "ck")
    _edit_config(folder, intermediate_size=192)

    def no_compile(*args: object, **kwargs: object) -> None:
        raise AssertionError("the planner traced before checking the weights")

    monkeypatch.setattr(autotp.planner, "compile_graph", no_compile)
    with pytest.raises(CheckpointError, match=r"has shape \(128, 64\) but the model built from config\.json"):
        autotp.planner.plan_model(folder, 2)
