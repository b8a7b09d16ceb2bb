"""The original module after ``torch.compile(model, backend="autotp")`` sharded it in place.

An in-memory model compiled with the backend holds its full weights on every rank until the first
call; then each sharded parameter is pointed at a zero-memory stand-in, so the rank keeps only
its shard (``backend._release_after_first_call``). The compiled module goes on working (its graphs
bind the shards), but the *uncompiled* ``model(...)`` would compute with the stand-ins. Giving it
correct results would mean keeping the full weights, which is what the release exists to avoid;
so a call of the original module raises instead: :func:`refuse_eager_calls` registers a forward
pre-hook on every module that owns a released parameter, and the hook raises an
:class:`~autotp.errors.AutoTPError` that says what happened and what to call instead. While Dynamo
traces the module (a recompile of the compiled model) the hook does nothing, so the compiled path
is unchanged; the stand-ins are NaN-filled as a last guard for code that reads a released
parameter outside any module call.

Owner modules are found by walking the live objects once per released graph (``gc.get_objects``):
the backend is handed parameters, not the modules that hold them.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from autotp.compat import recompile_limit
from autotp.context import meta_of
from autotp.errors import AutoTPError

__all__ = ["refuse_eager_calls"]

#: attribute on a module whose pre-hook is already registered (one hook per module)
_HOOKED = "_autotp_released_hook"


def _owner_modules(params: Sequence[torch.Tensor]) -> list[tuple[torch.nn.Module, list[str]]]:
    """Each live module whose own ``_parameters`` hold one of ``params``, with those names."""
    wanted = {id(p) for p in params}
    owners = []
    with warnings.catch_warnings():  # a deprecated alias's __class__ warns (torch.distributed.reduce_op)
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.nn.Module):
                    continue
            except Exception:  # noqa: BLE001 - an object whose __class__ lookup raises is not a module
                continue
            names = [n for n, p in obj._parameters.items() if p is not None and id(p) in wanted]
            if names:
                owners.append((obj, names))
    return owners


def _module_name(params: dict[str, Any], names: list[str]) -> str:
    for name in names:
        meta = meta_of(params[name])
        if meta is not None and meta.fqn.endswith(name):
            owner = meta.fqn[: -len(name)].rstrip(".")
            return owner or "the root module"
    return "a module"


def refuse_eager_calls(released: Sequence[torch.Tensor]) -> int:
    """Make every module owning one of the ``released`` parameters refuse an eager call; returns
    how many modules got the hook."""
    count = 0
    for module, names in _owner_modules(released):
        if getattr(module, _HOOKED, None) is not None:
            continue
        label = f"{_module_name(module._parameters, names)} ({type(module).__name__})"

        def refuse(mod: torch.nn.Module, args: Any, label: str = label) -> None:
            if torch.compiler.is_compiling():  # the compiled model tracing this module: fine
                return
            raise AutoTPError(
                f"{label} was sharded in place by torch.compile(model, backend='autotp') at the compiled "
                "model's first call: this process now holds only its shard of the weights, so the original, "
                "uncompiled module cannot run. Call the module torch.compile returned instead; to keep an "
                "unsharded copy as well, compile copy.deepcopy(model). If the compiled module was called, "
                "Dynamo ran its code uncompiled: past torch._dynamo.config.recompile_limit "
                f"({recompile_limit()}) compiled versions of a frame it does (TORCH_LOGS=recompiles lists "
                "why each was compiled); raise the limit or call the model with fewer kinds of arguments."
            )

        setattr(module, _HOOKED, module.register_forward_pre_hook(refuse))
        count += 1
    return count
