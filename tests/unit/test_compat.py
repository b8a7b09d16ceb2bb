"""Private torch and transformers internals are reached only through ``autotp/compat.py``, and a
missing one is named, with the installed versions, in an ``AutoTPError``."""

from __future__ import annotations

import ast
import contextlib
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from autotp import compat
from autotp.errors import AutoTPError

AUTOTP = Path(compat.__file__).resolve().parent
#: transformers modules autotp may import directly (public API)
PUBLIC_TRANSFORMERS = {"transformers", "transformers.utils", "transformers.cache_utils"}
#: files other work was editing when compat.py took the internals over; each still imports
#: torch.utils._pytree directly (use ``autotp.compat.pytree``) - shrink this set, never grow it
NOT_YET_MOVED = {"ops/registry.py", "ops/elementwise.py", "ops/_common.py"}


def _private(module: str) -> bool:
    head, *rest = module.split(".")
    if head == "torch":
        return any(part.startswith("_") for part in rest)
    return head == "transformers" and module not in PUBLIC_TRANSFORMERS


def private_uses(path: Path) -> list[str]:
    """``line: what`` for each import of, or ``torch._name`` attribute access to, a private
    torch / transformers internal in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [a.name for a in node.names]
            if _private(node.module) or (
                node.module.startswith("torch") and any(n.startswith("_") for n in names)
            ):
                out.append(f"{node.lineno}: from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            out += [f"{node.lineno}: import {a.name}" for a in node.names if _private(a.name)]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            out.append(f"{node.lineno}: torch.{node.attr}")
    return out


def test_no_module_but_compat_reaches_a_private_internal() -> None:
    found = {}
    for path in sorted(AUTOTP.rglob("*.py")):
        name = path.relative_to(AUTOTP).as_posix()
        if name != "compat.py" and name not in NOT_YET_MOVED and (uses := private_uses(path)):
            found[name] = uses
    assert found == {}, f"move these into autotp/compat.py: {found}"


def test_the_scan_sees_each_kind_of_private_use(tmp_path: Path) -> None:
    source = tmp_path / "x.py"
    source.write_text(
        "import torch\nfrom torch._decomp import x\nfrom torch.utils import _pytree\n"
        "import transformers.core_model_loading\ny = torch._dynamo.reset\nz = torch.__version__\n"
    )
    assert private_uses(source) == [
        "2: from torch._decomp import x",
        "3: from torch.utils import _pytree",
        "4: import transformers.core_model_loading",
        "5: torch._dynamo",
    ]


def test_a_missing_internal_is_named_with_the_installed_versions() -> None:
    with pytest.raises(AutoTPError) as info:
        compat.require("torch._dynamo.exc", "NoSuchName")
    message = str(info.value)
    assert "torch._dynamo.exc.NoSuchName" in message
    assert f"torch {torch.__version__}" in message and "transformers " in message
    assert compat.SUPPORTED in message and "scripts/check-latest" in message
    with pytest.raises(AutoTPError, match="torch.no_such_module"):
        compat.require_module("torch.no_such_module")


def test_the_probed_internals_are_the_real_ones() -> None:
    assert compat.linear_builtin is torch._C._nn.linear
    assert compat.functional_collectives().__name__ == "torch.distributed._functional_collectives"
    assert compat.causal_lm_class_name("llama") == "LlamaForCausalLM"
    assert compat.causal_lm_class_name("no-such-type") is None
    assert callable(compat.rope_init_functions()["llama3"])
    assert compat.weight_conversions().WeightConverter.__name__ == "WeightConverter"


def test_a_stored_graph_s_node_arguments_are_read_back_as_pytree_reads_them() -> None:
    """``compat._nodes_of_records`` walks a node's arguments itself where GraphPickler uses pytree
    (with slices mapped over, as while it unpickles): for every container FX keeps in arguments (and
    ones it hands to pytree: a named tuple, ``torch.Size``) the result equals pytree's, value and
    type, at every level."""
    from collections import namedtuple

    from torch.fx._graph_pickler import patch_pytree_map_over_slice

    a, b = compat._NodeRecord(), compat._NodeRecord()
    mapping = {a: "node a", b: "node b"}
    pair = namedtuple("pair", "first second")
    value = (a, [b, 1, 2.5, None, "s", torch.float32], compat.immutable_list([a, (b,)]),
             {"k": a, "j": [b]}, compat.immutable_dict(k=b), slice(a, None, 2), pair(a, 3), torch.Size([2, 3]),
             torch.device("cpu"), True)

    def typed(v: object) -> object:  # the value with every container's type spelled out
        if isinstance(v, (tuple, list)):
            return type(v), [typed(x) for x in v]
        if isinstance(v, dict):
            return type(v), [(k, typed(x)) for k, x in v.items()]
        if isinstance(v, slice):
            return slice, [typed(x) for x in (v.start, v.stop, v.step)]
        return type(v), v

    ours = compat._nodes_of_records(value, mapping)
    with patch_pytree_map_over_slice():
        theirs = compat.pytree.tree_map_only(compat._NodeRecord, mapping.__getitem__, value)
    assert typed(ours) == typed(theirs)
    assert ours[0] == "node a" and ours[5] == slice("node a", None, 2) and ours[6] == pair("node a", 3)


class _ByClassName(dict):
    """A dict that keys each item by its key's class name, as transformers' ``_CanRecordRegistry``."""

    def __setitem__(self, key: object, value: object) -> None:
        super().__setitem__(type(key).__name__, value)


def test_a_guard_state_keeps_a_re_keying_dict_s_keys_as_held() -> None:
    """Pickle's default replays a dict subclass's items through its own ``__setitem__``, which
    here re-keys them all to ``"str"``; a guard state holds them as they were (guards on the keys'
    order then load), and other values pickle as they did."""
    import io
    import pickle

    guards = compat.require_module("torch._dynamo.guards")
    registry = _ByClassName()
    registry[1], registry["a"] = "int", "str"
    assert list(pickle.loads(pickle.dumps(registry))) == ["str"]  # what a plain pickle makes of it
    with compat._dicts_pickled_as_held(guards.GuardsStatePickler):
        buffer = io.BytesIO()
        guards.GuardsStatePickler({}, {}, {}, buffer).dump({"registry": registry, "other": complex(1, 2)})
    loaded = pickle.loads(buffer.getvalue())
    assert type(loaded["registry"]) is _ByClassName and list(loaded["registry"].items()) == [("int", "int"),
                                                                                             ("str", "str")]
    assert loaded["other"] == complex(1, 2)
    assert "dispatch_table" not in guards.GuardsStatePickler.__dict__  # put back after the block


class _Forwarding:
    """An object whose ``__getattr__`` reads one of its own attributes, as ``api._EncoderEntry``."""

    def __init__(self, inner: object) -> None:
        self.__dict__.update(_inner=inner)

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def test_a_guard_state_unpickles_an_object_whose_getattr_reads_its_own_attributes() -> None:
    """Unpickled by pickle's default, such an object is asked for ``__setstate__`` before its
    attributes are back, and its ``__getattr__`` recurses (T5's first frame, which holds the
    encoder's ``get_encoder()`` entry: its frames were not shared). A guard state puts its
    attributes back without asking it, cycles included."""
    import io
    import pickle

    guards = compat.require_module("torch._dynamo.guards")
    entry = _Forwarding([1, 2])
    entry.itself = entry
    with pytest.raises(RecursionError):
        pickle.loads(pickle.dumps(entry))  # what a plain pickle makes of it
    with compat._dicts_pickled_as_held(guards.GuardsStatePickler):
        buffer = io.BytesIO()
        guards.GuardsStatePickler({}, {}, {}, buffer).dump({"entry": entry})
    loaded = pickle.loads(buffer.getvalue())["entry"]
    assert type(loaded) is _Forwarding and loaded._inner == [1, 2] and loaded.itself is loaded
    assert loaded.count(2) == 1  # and forwards as before
    assert not compat._forwarding_object(torch.nn.Linear)  # a module keeps its own __setstate__


def test_a_resume_function_s_code_is_read_through_dynamo_s_factory() -> None:
    """Dynamo installs a resume function with free variables as a factory closing over its code
    (``OutputGraph.install_resume_function_global``): its code is the resume function's, not the
    factory's (read as the factory's, the tracing rank's own resume function was "another
    function" than its entry's, and sharing frames stopped there)."""
    graph = compat.require("torch._dynamo.output_graph", "OutputGraph")
    module = compile("def outer():\n    y = 1\n    def inner():\n        return y\n    return inner", "<m>", "exec")
    outer = next(c for c in module.co_consts if hasattr(c, "co_consts"))
    inner = next(c for c in outer.co_consts if hasattr(c, "co_freevars"))
    assert inner.co_freevars == ("y",)
    installed: dict[str, object] = {}

    class Scope:
        def install_global_unsafe(self, name: str, value: object) -> None:
            installed[name] = value

    graph.install_resume_function_global(Scope(), "__resume_at_0_1", inner, {})
    assert compat._function_code(installed["__resume_at_0_1"]) is inner
    assert compat._function_code(len) is None  # not a function


def test_side_effects_are_replayed_unreported_unless_their_log_or_a_structured_trace_is_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo.config as dynamo_config

    def policy_in_block() -> str:
        with compat._side_effects_unreported():
            return dynamo_config.side_effect_replay_policy

    assert dynamo_config.side_effect_replay_policy == "info"  # torch's default
    assert policy_in_block() == "silent"
    assert dynamo_config.side_effect_replay_policy == "info"  # put back after the block
    torch._logging.set_logs(side_effects=True)
    try:
        assert policy_in_block() == "info"
    finally:
        torch._logging.set_logs()
    monkeypatch.setenv("TORCH_TRACE", "/tmp/trace")
    assert policy_in_block() == "info"
    monkeypatch.delenv("TORCH_TRACE")
    with dynamo_config.patch(side_effect_replay_policy="warn"):  # the user's own choice stays
        assert policy_in_block() == "warn"


def test_dynamo_names_a_line_s_function_only_while_a_trace_log_that_prints_it_is_on() -> None:
    import logging

    import torch._dynamo.symbolic_convert as convert

    line = private_uses.__code__.co_firstlineno + 3
    assert convert.get_funcname(__file__, line) == "private_uses"  # Dynamo's own lookup
    log = convert.trace_call_log
    level = log.level
    with compat._source_names_only_when_logged():
        assert convert.get_funcname(__file__, line) is None  # read by no log: not looked up
        log.setLevel(logging.DEBUG)
        try:
            assert convert.get_funcname(__file__, line) == "private_uses"
        finally:
            log.setLevel(level)
    assert convert.get_funcname(__file__, line) == "private_uses"  # restored


def test_a_source_cloned_through_a_transform_inside_the_block_equals_dynamo_s_clone() -> None:
    from torch._dynamo.source import AttrSource, GetItemSource, LocalSource

    layer = lambda i: GetItemSource(AttrSource(AttrSource(LocalSource("self"), "model"), "layers"), i)  # noqa: E731
    sources = [AttrSource(AttrSource(AttrSource(layer(0), "self_attn"), "q_proj"), name)
               for name in ("weight", "bias", "weight")]
    replacement = {layer(0): layer(3)}
    move = lambda s: replacement.get(s, s)  # noqa: E731  as Dynamo's region reuse check maps sources
    expected = [s.clone(move) for s in sources]
    dynamo_clone = torch._guards.ChainedSource.__dict__["clone"]
    with compat._source_clones_memoized():
        cloned = [s.clone(move) for s in sources]
        assert cloned[0] is cloned[2]  # one clone per source and transform
        assert [s.clone() for s in sources] == sources  # without a transform: Dynamo's own
    assert cloned == expected and cloned[0].name == "L['self'].model.layers[3].self_attn.q_proj.weight"
    assert torch._guards.ChainedSource.__dict__["clone"] is dynamo_clone  # restored


def test_a_stored_package_reserves_the_builtins_dict_torch_s_install_puts_in_the_module(tmp_path: Path) -> None:
    import torch._dynamo.bytecode_transformation as transformation

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    writer = compat.DynamoPackage(forward, backend=lambda gm, example: gm.forward)
    writer(torch.ones(2))
    entry, aliases = writer.entry()
    writer.uninstall()
    torch._dynamo.reset()
    # a later process whose counter is behind the writer's: the counter from 0 (put back after)
    following = next(transformation._unique_id_counter)
    transformation._unique_id_counter = itertools.count()
    reader = compat.DynamoPackage(forward, backend=lambda gm, example: gm.forward, stored=(entry, aliases),
                                  graphs={name: gm for name, gm in writer.graphs().items()})
    try:
        installed = [int(n.rsplit("_", 1)[1]) for n in globals() if n.startswith("__builtins_dict___")]
        assert installed, "the stored frame's builtins dict is in the module"
        assert int(transformation.unique_id("__builtins_dict__").rsplit("_", 1)[1]) > max(installed)
    finally:
        reader.uninstall()
        transformation._unique_id_counter = itertools.count(max(following, next(transformation._unique_id_counter)))


def _compiled_frames(monkeypatch: pytest.MonkeyPatch, once: bool,
                     unstorable: tuple[str, ...] = ()) -> tuple[list[list[str]], int, torch.Tensor]:
    """A prefill of a tiny Llama through a Dynamo package (its guard filter, which also drops the
    guard kinds ``unstorable``): each compiled frame's kept guards (name and kind, in order), how
    many guard builds ran, and the logits."""
    import contextlib

    from torch._dynamo.guards import CheckFunctionManager
    from transformers import DynamicCache

    from tests._tiny import tiny_model

    if not once:
        monkeypatch.setattr(compat, "_guards_built_once", contextlib.nullcontext)
    frames: list[list[str]] = []
    builds = []
    build, check = CheckFunctionManager.build_guards, CheckFunctionManager.compile_check_fn

    def counted_build(self: Any, *args: Any, **kwargs: Any) -> Any:
        builds.append(1)
        return build(self, *args, **kwargs)

    def recorded_check(self: Any, builder: Any, guards: list, fail: Any) -> Any:
        frames.append([f"{g.name} {g.create_fn_name()}" for g in guards])
        return check(self, builder, guards, fail)

    monkeypatch.setattr(CheckFunctionManager, "build_guards", counted_build)
    monkeypatch.setattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES",
                        (*CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES, *unstorable))
    monkeypatch.setattr(CheckFunctionManager, "compile_check_fn", recorded_check)
    model = tiny_model("llama")
    torch._dynamo.reset()
    package = compat.DynamoPackage(type(model).forward.__get__(model), backend=lambda gm, example: gm.forward)
    try:
        with torch.no_grad():
            logits = package(input_ids=torch.tensor([[5, 17, 99, 3]]), past_key_values=DynamicCache()).logits
    finally:
        package.uninstall()
    return frames, len(builds), logits


#: a guard kind only ever derived (``CONSTANT_MATCH`` on an int runs ``EQUALS_MATCH``): a filter that
#: drops it drops more once the guards are built, so the one build is narrowed and built again
DERIVED_ONLY = ("EQUALS_MATCH",)


@pytest.mark.parametrize("unstorable", [(), DERIVED_ONLY], ids=["package-filter", "a-derived-kind-dropped"])
def test_a_package_s_frame_keeps_the_guards_torch_s_two_builds_keep_building_them_once_where_it_can(
        monkeypatch: pytest.MonkeyPatch, unstorable: tuple[str, ...]) -> None:
    with monkeypatch.context() as m:
        twice, builds_twice, expected = _compiled_frames(m, once=False, unstorable=unstorable)
    once, builds_once, logits = _compiled_frames(monkeypatch, once=True, unstorable=unstorable)
    assert once == twice and len(once) >= 1 and all(once)
    assert builds_twice == 2 * len(twice)
    if unstorable:  # narrowed after the one build, then built again: torch's count
        assert builds_once == builds_twice
    else:
        assert builds_once == len(once)
    assert torch.equal(logits, expected)


def test_a_config_read_without_inlining_its_getattribute_traces_and_guards_as_the_inlined_read() -> None:
    """GPT-2's config maps ``hidden_size`` to ``n_embd`` (``attribute_map``). Compiled inside and
    outside the block, a function reading both names and a plain field gives the same results, the
    same graph, and recompiles when the same field changes; inside, Dynamo never inlines
    ``PretrainedConfig.__getattribute__``."""
    import transformers
    from torch._dynamo import symbolic_convert
    from torch._dynamo.testing import CompileCounterWithBackend

    def read(x: torch.Tensor, config: Any) -> torch.Tensor:
        return x * config.hidden_size + config.n_embd + config.layer_norm_epsilon

    inlined: list[str] = []
    inline_call = symbolic_convert.InliningInstructionTranslator.inline_call_

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        inlined.append(self.f_code.co_name)
        return inline_call(self, *args, **kwargs)

    def compile_twice(block: Any) -> tuple[list[torch.Tensor], int, list[str], str]:
        torch.compiler.reset()
        inlined.clear()
        counter = CompileCounterWithBackend("eager")
        config = transformers.GPT2Config(n_embd=8, layer_norm_epsilon=0.5)
        fn = torch.compile(read, backend=counter, fullgraph=True)
        x = torch.ones(2)
        symbolic_convert.InliningInstructionTranslator.inline_call_ = counting
        try:
            with block():
                first = fn(x, config)
                config.n_embd = 3  # the field behind both names: guarded, so compiled again
                second = fn(x, config)
        finally:
            symbolic_convert.InliningInstructionTranslator.inline_call_ = inline_call
        return [first, second], counter.frame_count, list(inlined), str(counter.graphs[0].graph)

    plain, uninlined = compile_twice(contextlib.nullcontext), compile_twice(compat.config_reads_uninlined)

    assert [t.tolist() for t in plain[0]] == [[16.5, 16.5], [6.5, 6.5]]  # x * 8 + 8 + 0.5, then with 3
    assert [t.tolist() for t in uninlined[0]] == [t.tolist() for t in plain[0]]
    assert plain[1] == uninlined[1] == 2  # the change recompiled in both
    assert "__getattribute__" in plain[2] and "__getattribute__" not in uninlined[2]
    assert uninlined[3] == plain[3]
