"""The one max_tokens policy (common.admission), as the gateway and the scheduler both apply it."""

import pytest

from common.admission import ContextLengthExceeded, context_budget
from common.errors import CONTEXT_LENGTH_EXCEEDED


def test_an_absent_max_tokens_is_the_default_capped_by_the_room():
    assert context_budget(10, None, 100, 256) == 90
    assert context_budget(10, None, 1000, 256) == 256


def test_an_explicit_max_tokens_that_fits_is_kept():
    assert context_budget(10, 90, 100, 256) == 90
    assert context_budget(100, 0, 100, 256) == 0  # prefill only: a prompt may fill the whole context


def test_an_explicit_max_tokens_that_does_not_fit_is_refused_naming_what_fits():
    with pytest.raises(ContextLengthExceeded) as caught:
        context_budget(10, 91, 100, 256)
    assert caught.value.code == CONTEXT_LENGTH_EXCEEDED and caught.value.param == "max_tokens"
    assert caught.value.message == ("the prompt (10 tokens) plus max_tokens (91) exceeds the model's context of 100 "
                                    "tokens; ask for at most 90")


@pytest.mark.parametrize("max_tokens", [None, 1, 256])
def test_a_prompt_that_leaves_no_room_is_refused(max_tokens):
    with pytest.raises(ContextLengthExceeded) as caught:
        context_budget(100, max_tokens, 100, 256)
    assert caught.value.param == "prompt" and "the model's context of 100 tokens leaves no room" in caught.value.message
