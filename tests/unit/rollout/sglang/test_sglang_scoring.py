"""The scoring wire format (rollout/sglang/scoring.py) without a server: the payload asks for no new token and the
log-probs from prompt_len - 1; a reply is read only when it holds the positions and tokens sent (the real server's
replies: tests/sglang/test_rollout_sglang_real.py)."""

from __future__ import annotations

import pytest

from megatron_dapo.rollout.sglang.scoring import parse_scores, score_payload

TOKENS, PROMPT = [5, 6, 7, 20, 21, 22], 3


def _reply(entries):
    return {"meta_info": {"input_token_logprobs": entries}}


def test_the_payload_prefills_the_sequence_and_asks_from_the_last_prompt_token():
    body = score_payload(TOKENS, PROMPT)
    assert body == {"input_ids": TOKENS, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                    "logprob_start_len": 2, "stream": False}


def test_a_reply_gives_the_response_tokens_log_probs():
    entries = [[None, 7, None], [-1.5, 20, None], [-0.25, 21, None], [-3.0, 22, None]]
    assert parse_scores(_reply(entries), TOKENS, PROMPT) == [-1.5, -0.25, -3.0]


@pytest.mark.parametrize("entries, match", [
    ([[None, 7, None], [-1.5, 20, None]], "2 input log-probs, expected 4"),
    ([[None, 7, None], [-1.5, 20, None], [-0.25, 99, None], [-3.0, 22, None]], "not the ones sent"),
    ([[None, 7, None], [-1.5, 20, None], [None, 21, None], [-3.0, 22, None]], "has no log-prob"),
])
def test_a_reply_that_does_not_match_what_was_sent_is_refused(entries, match):
    with pytest.raises(ValueError, match=match):
        parse_scores(_reply(entries), TOKENS, PROMPT)
    with pytest.raises(ValueError, match="no meta_info.input_token_logprobs"):
        parse_scores({"text": ""}, TOKENS, PROMPT)


def test_sglangs_zero_for_the_last_vocabulary_id_is_read_as_the_id_sent():
    """SGLang 0.5.23 reports the model's last vocabulary id as 0 (see parse_scores): accepted for the request's
    largest id only, a 0 in place of any other id is still a mismatch."""
    entries = [[None, 7, None], [-1.5, 20, None], [-0.25, 21, None], [-3.0, 0, None]]
    assert parse_scores(_reply(entries), TOKENS, PROMPT) == [-1.5, -0.25, -3.0]
    entries[2][1] = 0
    with pytest.raises(ValueError, match="at position 4 of 6 it has 0, 21 was sent"):
        parse_scores(_reply(entries), TOKENS, PROMPT)
