"""Checks on what the user passes to a parallelized model, before any graph runs.

Token ids index an embedding table. In one process an id outside ``[0, rows)`` makes
``torch.embedding`` raise ``IndexError``; under tensor parallelism the table is split by rows and
each rank looks up only the ids inside its own range (``ops/embedding.py``), so an id outside
*every* range silently becomes a zero vector and the model returns finite, wrong logits. So the
ids are checked here, on the tensors the user passed, on every rank, before the stand-ins are
swapped in and before the compiled graph runs: one reduction (``aminmax``) per id tensor, and
the bad id, its position and the table's size only when it fails. Nothing is changed by a
refused call, so the model keeps working for the next one.

:class:`TokenIdCheck` is built once per entry point (``parallelize_model``'s ``forward`` and an
encoder-decoder's encoder) from the model's own embeddings.

The KV cache is the other input that can be silently wrong. A sharded cache entry is a NaN-filled,
zero-memory stand-in that carries this rank's shard (``context.sharded_standin``); code that
replaces it eagerly between steps (a clone, a crop, a beam reorder with ``index_select``) leaves
a plain tensor of NaN where the shard was, which a graph compiled for it would read as a
replicated cache: NaN logits, no error. :class:`CacheWatch` remembers, after each call, which
entries of each cache the model returned sharded, and refuses the next call with that cache when
one of them is no longer a sharded stand-in. Caches that never held sharded entries (a
``StaticCache``, replicated; a cache the user built) are left alone.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from autotp.context import shard_of
from autotp.errors import AutoTPError
from autotp.kv_cache import caches_in
from autotp.sharded_cache import follow_edits

__all__ = ["CacheWatch", "InputGuard", "TokenIdCheck", "check_mask", "check_token_ids"]

#: arguments of a transformers ``forward`` that hold token ids, and how to find the table each
#: one indexes (the decoder's own embeddings where the model has them, e.g. Marian)
_ID_ARGUMENTS = ("input_ids", "decoder_input_ids")


def _rows(embedding: Any) -> int | None:
    weight = getattr(embedding, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])  # global rows: the stand-in or the full table
    rows = getattr(embedding, "num_embeddings", None)
    return rows if isinstance(rows, int) else None


def _table_rows(model: torch.nn.Module) -> dict[str, int]:
    """``{argument: rows of the table it indexes}`` for the model's id arguments."""
    sizes: dict[str, int] = {}
    getter = getattr(model, "get_input_embeddings", None)
    rows = _rows(getter()) if callable(getter) else None
    if rows is not None:
        sizes["input_ids"] = rows
        sizes["decoder_input_ids"] = rows
    decoder = getattr(model, "get_decoder", None)
    if callable(decoder) and getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        try:
            dec = decoder()
            dec_rows = _rows(dec.get_input_embeddings()) if hasattr(dec, "get_input_embeddings") else None
        except (AttributeError, NotImplementedError, TypeError):
            dec_rows = None
        if dec_rows is not None:
            sizes["decoder_input_ids"] = dec_rows
    return sizes


@dataclass(frozen=True)
class TokenIdCheck:
    """Refuses token ids outside the embedding table of the argument that carries them.

    ``rows`` maps each id argument (``input_ids``, ``decoder_input_ids``) to its table's global
    number of rows; ``positional`` names the ``forward``'s positional parameters, so an id
    tensor passed by position is found too."""

    rows: Mapping[str, int]
    positional: tuple[str, ...]

    @classmethod
    def for_model(cls, model: torch.nn.Module, forward: Callable[..., Any]) -> TokenIdCheck | None:
        """The check for ``forward`` (a bound ``forward`` of ``model`` or of its encoder), or None
        when the model has no embedding table to check against."""
        rows = _table_rows(model)
        if not rows:
            return None
        try:
            params = inspect.signature(forward).parameters.values()
        except (TypeError, ValueError):
            params = ()
        positional = tuple(p.name for p in params
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self")
        return cls(rows=dict(rows), positional=positional)

    def __call__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        named = dict(zip(self.positional, args, strict=False))
        named.update(kwargs)
        if isinstance(named.get("inputs_embeds"), torch.Tensor):
            return  # embeddings given: no ids are looked up (the model decides what else it accepts)
        for name in _ID_ARGUMENTS:
            value = named.get(name)
            if isinstance(value, torch.Tensor) and name in self.rows:
                check_token_ids(name, value, self.rows[name])
        check_mask(named.get("input_ids"), named.get("attention_mask"))


def check_mask(ids: Any, mask: Any) -> None:
    """A 2-D ``attention_mask`` must have the batch of ``input_ids`` and cover at least its tokens
    (it also covers cached positions); other layouts (a 4-D custom mask) are the model's to check."""
    if not (isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor)) or ids.dim() != 2 or mask.dim() != 2:
        return
    if mask.shape[0] != ids.shape[0] or mask.shape[1] < ids.shape[1]:
        raise AutoTPError(
            f"attention_mask has shape {tuple(mask.shape)} but input_ids has {tuple(ids.shape)}: a 2-D mask is "
            "(batch, cached + new tokens), with input_ids' batch and at least its length. Pass the mask the "
            "tokenizer returned with these ids."
        )


def check_token_ids(name: str, ids: torch.Tensor, rows: int) -> None:
    """Raise an :class:`AutoTPError` naming the first id of ``ids`` outside ``[0, rows)``, its
    position and ``rows``; refuse ids that are not integers and an empty tensor."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise AutoTPError(f"{name} must hold integer token ids (torch.long), got dtype {ids.dtype}; "
                          f"pass {name}.long() or the tokenizer's output")
    if ids.numel() == 0:
        raise AutoTPError(f"{name} is empty (shape {tuple(ids.shape)}): pass at least one token for each row")
    lo, hi = torch.aminmax(ids.detach())
    lo_v, hi_v = torch.stack([lo, hi]).tolist()  # one device sync
    if lo_v >= 0 and hi_v < rows:
        return
    bad = (ids < 0) | (ids >= rows)
    count = int(bad.sum())
    first = tuple(int(i) for i in bad.nonzero()[0].tolist())
    value = int(ids[first])
    more = f" ({count} ids are out of range; smallest {lo_v}, largest {hi_v})" if count > 1 else ""
    raise AutoTPError(
        f"{name}[{', '.join(map(str, first))}] is token id {value}, but the vocabulary has {rows} entries (valid ids: 0 to "
        f"{rows - 1}){more}. One process would raise IndexError here; under tensor parallelism such an id would "
        "be embedded as zeros. Check the tokenizer matches the checkpoint, or clamp/mask the ids."
    )


def _entries(cache: Any) -> Iterator[tuple[tuple[int, str], torch.Tensor]]:
    for i, layer in enumerate(cache.layers):
        for name, v in vars(layer).items():
            if isinstance(v, torch.Tensor):
                yield (i, name), v


@dataclass
class CacheWatch:
    """Which entries of each live cache the model last returned sharded (by ``id``, dropped when
    the cache is garbage-collected)."""

    sharded: dict[int, tuple[weakref.ref, frozenset[tuple[int, str]]]] = field(default_factory=dict)

    def before(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Refuse a cache one of whose sharded entries was replaced since the model returned it."""
        for cache in caches_in((args, dict(kwargs))):
            known = self.sharded.get(id(cache))
            if known is None or known[0]() is not cache:
                continue
            current = dict(_entries(cache))
            for where in sorted(known[1]):
                if where not in current or shard_of(current[where]) is None:
                    layer, name = where
                    raise AutoTPError(
                        f"the KV cache passed in was changed outside the model: layer {layer}'s {name!r} was a "
                        "sharded entry this model returned (each rank holds only its heads) and is now "
                        f"{'gone' if where not in current else 'a plain tensor'} (e.g. cloned or sliced "
                        "eagerly; the cache's own methods, such as beam search's reorder_cache and crop, "
                        "work). Keep the cache the parallelized model returned as it is, start a new one, "
                        "or pass use_cache=False."
                    )

    def after(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], result: Any) -> None:
        """Remember the sharded entries of every cache the call used or returned, and make the
        library's own edits of it (beam search's reorder, crop, ...) act on the shards
        (:func:`autotp.sharded_cache.follow_edits`)."""
        for cache in caches_in((args, dict(kwargs), result)):
            where = frozenset(k for k, v in _entries(cache) if shard_of(v) is not None)
            key = id(cache)
            if not where:
                self.sharded.pop(key, None)
                continue
            follow_edits(cache)
            if key not in self.sharded or self.sharded[key][0]() is not cache:
                ref = weakref.ref(cache, lambda _r, key=key, sharded=self.sharded: sharded.pop(key, None))
            else:
                ref = self.sharded[key][0]
            self.sharded[key] = (ref, where)


@dataclass
class InputGuard:
    """What a parallelized model's entry checks before a call (token ids, the KV cache) and
    records after it (the cache's sharded entries)."""

    tokens: TokenIdCheck | None
    caches: CacheWatch = field(default_factory=CacheWatch)

    def before(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        if self.tokens is not None:
            self.tokens(args, kwargs)
        self.caches.before(args, kwargs)

    def after(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], result: Any) -> None:
        self.caches.after(args, kwargs, result)
