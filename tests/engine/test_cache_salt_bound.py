"""`cache_salt` is bounded (tandem.core.limits.MAX_CACHE_SALT_CHARS) wherever a request comes in: the
input processor (offline `LLM`, the engine API, the server after its own 400) refuses a longer one
with a ValueError naming it. Before, any length was taken, and each salt stayed in the engine."""

from __future__ import annotations

import pytest

from tandem.core.limits import MAX_CACHE_SALT_CHARS, EngineLimits, check_cache_salt
from tandem.engine.processor import InputProcessor
from tandem.engine.tokenizer import Tokenizer


def test_the_bound_names_the_field():
    check_cache_salt(None)
    check_cache_salt("s" * MAX_CACHE_SALT_CHARS)
    with pytest.raises(ValueError, match="cache_salt"):
        check_cache_salt("s" * (MAX_CACHE_SALT_CHARS + 1))


def test_the_input_processor_refuses_a_longer_salt(tokenizer_dir):
    inputs = InputProcessor(Tokenizer(str(tokenizer_dir)), EngineLimits(512, 64, 16, 64, 4))
    ok, _ = inputs.process("a", {"prompt_token_ids": [1, 2], "cache_salt": "s" * MAX_CACHE_SALT_CHARS})
    assert ok.cache_salt == "s" * MAX_CACHE_SALT_CHARS
    for long in ({"cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)}, {}):
        with pytest.raises(ValueError, match="cache_salt"):
            inputs.process("b", {"prompt_token_ids": [1, 2], **long}, cache_salt="t" * (8 << 20))
