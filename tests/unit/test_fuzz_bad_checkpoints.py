"""Fuzz: generated bad configs and checkpoints, each loaded with ``parallelize_model`` (one process).

Every case must end in an :class:`~autotp.errors.AutoTPError` before anything is compiled (the
model is never traced: ``torch.compile`` is replaced by a function that fails the case), within a
hang guard (an alarm per case), and nothing may be written into the checkpoint folder (every file's
bytes and the listing are compared before and after). The cases are drawn from a seeded
generator: configs with zero or negative sizes, mismatched head counts, absurd vocabularies,
strings for sizes, unknown architectures and model types, broken JSON; checkpoints with a missing
tensor, a tensor stored twice, an integer / boolean / complex tensor for a float parameter, a file
truncated at a random byte, safetensors headers that lie about offsets, lengths and shapes, and
indexes that name missing files or tensors. The inputs half (bad ids, empty batches, wrong dtypes,
masks of the wrong shape) runs on two ranks: ``tests/distributed/test_fuzz_inputs.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import autotp.api
from autotp import parallelize_model
from autotp.errors import AutoTPError
from tests._tiny import save_tiny

#: seconds one case may take before the hang guard fails it (a load that fails early takes ~1 s)
HANG_GUARD_S = 120
SEED = 21

Case = tuple[str, Callable[[Path], None]]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz")
    return {"single": save_tiny("llama", root / "single"), "sharded": save_tiny("llama", root / "sharded", shards=2)}


def _edit_json(path: Path, **fields: object) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


def _config_cases(rng: random.Random) -> Iterator[Case]:
    fields = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size"]
    for name in fields:
        for value in (0, -1, -rng.randint(2, 10**6)):
            yield f"config {name}={value}", lambda f, n=name, v=value: _edit_json(f / "config.json", **{n: v})
    for kv in (3, 5, 16, 7):
        yield f"config num_key_value_heads={kv} with 8 heads", \
            lambda f, kv=kv: _edit_json(f / "config.json", num_key_value_heads=kv)
    for vocab in (10**9, 10**12, 129, 127):
        yield f"config vocab_size={vocab}", lambda f, v=vocab: _edit_json(f / "config.json", vocab_size=v)
    for hidden in (63, 72, 128):
        yield f"config hidden_size={hidden}", lambda f, h=hidden: _edit_json(f / "config.json", hidden_size=h)
    yield "config sizes as strings", lambda f: _edit_json(f / "config.json", hidden_size="64", vocab_size="x")
    yield "config unknown architecture", lambda f: _edit_json(f / "config.json", architectures=["NoSuchForCausalLM"])
    yield "config unknown model_type", lambda f: _edit_json(f / "config.json", model_type="no_such_model")
    yield "config not JSON", lambda f: (f / "config.json").write_text("{not json")
    yield "config a JSON list", lambda f: (f / "config.json").write_text("[1, 2]")
    yield "config deleted", lambda f: (f / "config.json").unlink()
    for _ in range(6):  # two sizes broken at once
        a, b = rng.sample(fields, 2)
        va, vb = rng.choice([0, -3]), rng.choice([0, -5, 10**10])
        yield f"config {a}={va}, {b}={vb}", lambda f, a=a, b=b, va=va, vb=vb: _edit_json(
            f / "config.json", **{a: va, b: vb})


def _rewrite(path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(os.fspath(path))
    change(tensors)
    save_file(tensors, os.fspath(path), metadata={"format": "pt"})


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(path: Path, header: dict, data: bytes, length: int | None = None) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def _lie(kind: str, name: str, amount: int) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        path = folder / "model.safetensors"
        header, data = _header(path)
        entry = header[name]
        begin, end = entry["data_offsets"]
        if kind == "past the end":
            entry["data_offsets"] = [begin + len(data), end + len(data) + amount]
        elif kind == "length disagrees with shape":
            entry["data_offsets"] = [begin, end - 4 * amount]
        elif kind == "negative start":
            entry["data_offsets"] = [-amount, end]
        elif kind == "shape grows":
            entry["shape"] = [entry["shape"][0] + amount, *entry["shape"][1:]]
        elif kind == "unknown dtype":
            entry["dtype"] = "F7"
        elif kind == "offsets missing":
            del entry["data_offsets"]
        _write_header(path, header, data)
    return apply


def _checkpoint_cases(rng: random.Random, names: list[str]) -> Iterator[Case]:
    for name in rng.sample(names, 12):
        yield f"tensor {name} missing", lambda f, n=name: _rewrite(f / "model.safetensors", lambda t: t.pop(n))
    dtypes = [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]
    for name in rng.sample(names, 12):
        dtype = rng.choice(dtypes)

        def to_dtype(t: dict[str, torch.Tensor], n: str = name, d: torch.dtype = dtype) -> None:
            t[n] = torch.ones(t[n].shape, dtype=d)

        yield f"tensor {name} stored as {dtype}", lambda f, change=to_dtype: _rewrite(f / "model.safetensors", change)
    for name in rng.sample(names, 6):
        def wrong_shape(t: dict[str, torch.Tensor], n: str = name) -> None:
            t[n] = torch.zeros(*[s + 1 for s in t[n].shape])

        yield f"tensor {name} one larger in every dim", lambda f, c=wrong_shape: _rewrite(f / "model.safetensors", c)
    for _ in range(20):
        frac = rng.random()

        def truncate(f: Path, frac: float = frac) -> None:
            path = f / "model.safetensors"
            size = path.stat().st_size
            with open(path, "r+b") as fh:
                fh.truncate(max(int(size * frac), 1) if frac < 0.999 else size - 1)

        yield f"file truncated at {frac:.3f} of its size", truncate
    kinds = ["past the end", "length disagrees with shape", "negative start", "shape grows", "unknown dtype",
             "offsets missing"]
    for _ in range(24):
        kind, name = rng.choice(kinds), rng.choice(names)
        yield f"header: {name} {kind}", _lie(kind, name, rng.randint(1, 64))
    yield "header length larger than the file", lambda f: _write_header(
        f / "model.safetensors", *_header(f / "model.safetensors"), length=10**9)
    yield "header not JSON", lambda f: (f / "model.safetensors").write_bytes(
        struct.pack("<Q", 10) + b"not json!!" + b"\0" * 64)
    yield "header a JSON list", lambda f: (f / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"[]")
    yield "file shorter than its length field", lambda f: (f / "model.safetensors").write_bytes(b"\x01\x02")
    yield "weights deleted", lambda f: (f / "model.safetensors").unlink()
    for name in rng.sample(names, 4):
        def stored_twice(f: Path, n: str = name) -> None:
            path = f / "model.safetensors"
            path.rename(f / "part-a.safetensors")  # no index, no model.safetensors: every file is read
            save_file({n: load_file(os.fspath(f / "part-a.safetensors"))[n]}, os.fspath(f / "part-b.safetensors"))

        yield f"tensor {name} stored in two files", stored_twice


def _index_cases(rng: random.Random, names: list[str]) -> Iterator[Case]:
    index = "model.safetensors.index.json"
    yield "index names a missing shard", lambda f: (f / "model-00002-of-00002.safetensors").unlink()
    for name in rng.sample(names, 4):
        def misplaced(f: Path, n: str = name) -> None:
            data = json.loads((f / index).read_text())
            shard = data["weight_map"][n]
            data["weight_map"][n] = next(s for s in set(data["weight_map"].values()) if s != shard)
            (f / index).write_text(json.dumps(data))

        yield f"index puts {name} in the wrong shard", misplaced
    for name in rng.sample(names, 3):
        def dropped(f: Path, n: str = name) -> None:
            data = json.loads((f / index).read_text())
            del data["weight_map"][n]
            (f / index).write_text(json.dumps(data))

        yield f"index leaves out {name}", dropped
    yield "index not JSON", lambda f: (f / index).write_text("{")
    yield "index without weight_map", lambda f: (f / index).write_text(json.dumps({"metadata": {}}))


def _snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


class _Hang(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise _Hang(f"a case ran past the {HANG_GUARD_S} s hang guard")


def test_generated_bad_configs_and_checkpoints_each_end_in_one_autotp_error_before_compiling(
        pristine: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compile(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.compile was reached: the bad input was not found up front")

    monkeypatch.setattr(autotp.api.torch, "compile", no_compile)
    rng = random.Random(SEED)
    names = sorted(load_file(os.fspath(pristine["single"] / "model.safetensors")))
    cases = [("single", c) for c in [*_config_cases(rng), *_checkpoint_cases(rng, names)]]
    cases += [("sharded", c) for c in _index_cases(rng, names)]
    assert len(cases) >= 130
    previous = signal.signal(signal.SIGALRM, _alarm)
    failures = []
    try:
        for i, (layout, (label, mutate)) in enumerate(cases):
            folder = Path(shutil.copytree(pristine[layout], tmp_path / f"case{i:03d}"))
            mutate(folder)
            before = _snapshot(folder)
            signal.alarm(HANG_GUARD_S)
            try:
                parallelize_model(folder, progress=False)
                outcome = "loaded without an error"
            except AutoTPError as e:
                outcome = "ok" if str(e).strip() else "an empty AutoTPError"
            except Exception as e:  # noqa: BLE001 - every other ending is a failure of the case
                outcome = f"{type(e).__name__}: {str(e)[:300]}"
            finally:
                signal.alarm(0)
            if _snapshot(folder) != before:
                outcome = "the checkpoint folder was written into"
            if outcome != "ok":
                failures.append(f"{label}: {outcome}")
            shutil.rmtree(folder)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)
