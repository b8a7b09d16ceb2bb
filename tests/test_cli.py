"""The ``autotp`` command line: the demo end to end, and bad input reported without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autotp.cli import main

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "autotp", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_demo_tp2_tokens_identical_to_one_process(tmp_path: Path) -> None:
    # Two gloo ranks through torch's elastic launcher; greedy tokens must match one process exactly
    # (the demo model's top-2 logit gaps are far above fp32 reordering noise).
    proc = _run("demo", "--tp", "2", "--new-tokens", "4", "--workdir", str(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tokens identical to one process: yes" in proc.stdout, proc.stdout
    assert "all 2 ranks produced the same tokens: yes" in proc.stdout
    assert "collectives per forward:" in proc.stdout and "parameter bytes per rank:" in proc.stdout
    assert (tmp_path / "checkpoint" / "model.safetensors").exists()


def test_bad_tp_exits_2_with_a_readable_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--tp", "0"]) == 2
    err = capsys.readouterr().err
    assert "autotp: error: --tp must be a positive integer, got 0" in err
    assert "Traceback" not in err


def test_tp_that_does_not_divide_the_model_exits_2_before_launching(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    # 8 heads / 4 kv heads: tp=3 is refused from the config alone, before a checkpoint is written
    # (tp=8 is valid: each kv head is then held by 2 ranks).
    assert main(["demo", "--tp", "3", "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "tp_size=3 does not divide" in err and "Valid tp sizes for this model: [1, 2, 4, 8]" in err
    assert "Traceback" not in err
    assert not (tmp_path / "checkpoint").exists()


def test_bad_prompt_ids_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["generate", str(tmp_path), "--tp", "1", "--prompt-ids", "1,two,3"]) == 2
    assert "--prompt-ids must be comma-separated integers" in capsys.readouterr().err


def test_missing_checkpoint_folder_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["generate", str(tmp_path / "nope"), "--tp", "1", "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autotp: error: ") and "Traceback" not in err


def test_python_dash_m_autotp_reports_errors_without_traceback() -> None:
    proc = _run("demo", "--tp", "0", timeout=300)
    assert proc.returncode == 2
    assert "autotp: error: --tp must be a positive integer" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_usage_errors_and_help() -> None:
    assert main([]) == 2  # a subcommand is required; argparse prints the usage
    assert main(["--help"]) == 0


def _save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the tiny vocabulary: token i is the word ``w{i}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)


@pytest.mark.slow
def test_generate_streams_text_from_a_prompt_and_samples_the_tokens_of_one_process(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from tests._tiny import save_tiny

    folder = save_tiny("llama", tmp_path / "ckpt", seed=0, num_hidden_layers=2)
    _save_word_tokenizer(folder, 128)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.manual_seed(3)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([[5, 17, 99]]), max_new_tokens=4, do_sample=True, top_k=50,
                                      temperature=1.0, top_p=1.0)[0, 3:].tolist()
    proc = _run("generate", str(folder), "--tp", "2", "--prompt", "w5 w17 w99", "--max-new-tokens", "4",
                "--do-sample", "--seed", "3", timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all 2 ranks produced the same tokens: yes" in proc.stdout
    assert f"generated ids: {expected}" in proc.stdout, proc.stdout
    words = " ".join(f"w{t}" for t in expected)
    assert f"text: {words}" in proc.stdout
    assert words in proc.stdout.split("text:")[0]  # streamed before the summary
    # one generate: the time to its first token apart from the decode rate after its last compile
    assert "generated 4 tokens in " in proc.stdout and "first token after " in proc.stdout, proc.stdout
    assert "(no compile in that span)" in proc.stdout or "no decode step after the last compile" in proc.stdout


def test_generate_needs_exactly_one_prompt(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["generate", str(tmp_path), "--tp", "1"]) == 2
    assert "exactly one of them" in capsys.readouterr().err


# --- every failure the user can cause: one line, exit 2, before anything is launched or planned ---


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("autotp: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests._tiny import save_tiny

    return save_tiny("llama", tmp_path_factory.mktemp("tiny") / "ckpt")


def _no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    import autotp.cli

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("ranks were launched before the bad input was found")

    monkeypatch.setattr(autotp.cli, "_launch", refuse)


def test_prompt_ids_outside_the_vocabulary_exit_2_before_launching(
        tiny_folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _no_launch(monkeypatch)
    assert main(["generate", str(tiny_folder), "--tp", "1", "--prompt-ids", "5,17,128"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--prompt-ids[2] is token id 128, but the vocabulary has 128 entries" in line


def test_an_unknown_model_type_is_one_line_in_generate_and_plan(
        tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import shutil

    folder = Path(shutil.copytree(tiny_folder, tmp_path / "future"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama_from_the_future"}))
    _no_launch(monkeypatch)
    for argv in (["generate", str(folder), "--tp", "1", "--prompt-ids", "1,2"], ["plan", str(folder), "--tp", "2"]):
        assert main(argv) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert "model_type 'llama_from_the_future'" in line and line.endswith("fix model_type in config.json.")


def test_a_checkpoint_that_disagrees_with_the_config_exits_2_before_launching(
        tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import shutil

    folder = Path(shutil.copytree(tiny_folder, tmp_path / "wrong"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 192}))
    _no_launch(monkeypatch)
    assert main(["generate", str(folder), "--tp", "2", "--prompt-ids", "1,2"]) == 2
    assert "but the model built from config.json expects (192, 64)" in _one_error_line(capsys.readouterr().err)


def test_debug_shows_the_traceback_after_the_one_line(tiny_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # in this process: main() prints both (python -m autotp's exit and stderr: the test above); each
    # fresh interpreter cost ~5 CPU-s of imports
    assert main(["--debug", "generate", str(tiny_folder), "--tp", "1", "--prompt-ids", "1,999"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("autotp: error: ")
    assert main(["generate", str(tiny_folder), "--tp", "1", "--prompt-ids", "1,999", "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_a_multi_line_rank_error_is_printed_whole_on_one_line() -> None:
    from autotp.cli import one_line

    assert one_line("rank 0: bad thing\n  because of x\n") == "rank 0: bad thing because of x"


def test_more_cuda_ranks_than_gpus_exit_2_before_launching(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # on a one-GPU machine NCCL's second rank failed with "CUDA error: invalid device ordinal"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["generate", str(tmp_path), "--tp", "2", "--device", "cuda", "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "--tp 2 --device cuda runs 2 ranks on this machine" in err and "has 1 GPU" in err


# --- the ranks' launch: forked from a server that imported the heavy modules once ---


def test_every_module_the_rank_server_preloads_exists() -> None:
    # the forkserver skips a preload module that does not import, silently: each rank would then import it
    import importlib.util

    from autotp.cli import RANK_PRELOAD

    assert [name for name in RANK_PRELOAD if importlib.util.find_spec(name) is None] == []


def test_the_rank_server_preloads_transformers_modeling_code_and_no_remote_code() -> None:
    from transformers import LlamaForCausalLM

    from autotp.cli import _modeling

    class RemoteCode:  # a checkpoint's own modeling code: each rank imports it itself
        pass

    assert _modeling(LlamaForCausalLM) == "transformers.models.llama.modeling_llama"
    assert _modeling(RemoteCode) is None


# --- the timing line of one generate: time to first token apart from the decode rate after the last compile ---


def test_the_decode_rate_is_taken_over_the_tokens_after_the_last_compile() -> None:
    from autotp.cli import _generate_timing, _throughput

    # prefill 0.5 s; the first two decode steps each compile a graph; then 3 steady steps of 0.1 s
    token_s, compiled = [0.5, 1.5, 2.5, 2.6, 2.7, 2.8], [0, 1, 2, 2, 2, 2]
    timing = _generate_timing(token_s, compiled)
    assert (timing["first_token_s"], timing["graphs_compiled"], timing["last_compile_token"]) == (0.5, 2, 3)
    assert timing["decode_tokens"] == 3 and timing["decode_s"] == pytest.approx(0.3)
    line = _throughput({"token_s": token_s, "graphs_compiled_by_token": compiled, "generate_s": 3.0})
    assert line == ("generated 6 tokens in 2.80 s (rank 0): first token after 0.50 s; 2 graph(s) compiled, the last "
                    "in token 3's step (out after 2.50 s); decode 10.00 tokens/s over the 3 token(s) after that compile "
                    "(no compile in that span)")


def test_with_no_compile_the_decode_rate_starts_after_the_first_token_and_without_a_step_it_says_so() -> None:
    from autotp.cli import _generate_timing, _throughput

    timing = _generate_timing([0.2, 0.3, 0.4], [0, 0, 0])
    assert (timing["last_compile_token"], timing["decode_tokens"]) == (0, 2)
    assert timing["decode_s"] == pytest.approx(0.2)  # the prefill (first token) is never in the decode span
    line = _throughput({"token_s": [0.5, 1.5], "graphs_compiled_by_token": [0, 1], "generate_s": 1.6})
    assert line.endswith("1 graph(s) compiled, the last in token 2's step (out after 1.50 s); no decode step after "
                         "the last compile to time (ask for more --max-new-tokens)")
