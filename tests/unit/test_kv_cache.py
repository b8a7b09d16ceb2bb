"""The KV-cache argument is found under either name transformers has used for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotp.kv_cache import cache_keyword, returned_cache


def test_the_cache_keyword_is_read_from_the_signature_under_the_new_or_the_old_name() -> None:
    def new(self: Any, input_ids: Any = None, cache: Any = None) -> None: ...
    def old(self: Any, input_ids: Any = None, past_key_values: Any = None) -> None: ...
    def none(self: Any, input_ids: Any = None) -> None: ...

    assert (cache_keyword(new), cache_keyword(old), cache_keyword(none)) == ("cache", "past_key_values", None)


def test_the_returned_cache_is_read_from_the_field_the_output_has() -> None:
    @dataclass
    class New:
        logits: Any = None
        cache: Any = None

        @property
        def past_key_values(self) -> Any:
            raise AssertionError("the deprecated property must not be read")

    @dataclass
    class Old:
        logits: Any = None
        past_key_values: Any = None

    marker = object()
    assert returned_cache(New(cache=marker)) is marker
    assert returned_cache(Old(past_key_values=marker)) is marker
    assert returned_cache(Old()) is None
