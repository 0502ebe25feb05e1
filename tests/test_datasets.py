"""The prompt sets drawn from the shipped data: deterministic, bounded, first user turns only."""

from __future__ import annotations

from specdistill.data.datasets import FirstTurn, humaneval_prompts, sharegpt_first_turns
from tests.conftest import train_bpe


def test_first_turns_are_deterministic_bounded_and_distinct():
    turns = sharegpt_first_turns(12, min_chars=20, max_chars=400)
    assert turns == sharegpt_first_turns(12, min_chars=20, max_chars=400)
    assert len(turns) == 12 and all(isinstance(t, FirstTurn) for t in turns)
    for t in turns:
        assert t.messages[-1]["role"] == "user" and t.text == t.messages[-1]["content"]
        assert 20 <= len(t.text) <= 400
        assert all(m["role"] == "system" for m in t.messages[:-1])
    assert len({t.text.strip() for t in turns}) == len(turns)
    assert sharegpt_first_turns(0) == []


def test_limit_is_a_prefix_and_filters_narrow_the_set():
    wide = sharegpt_first_turns(scan=60)
    assert sharegpt_first_turns(5, scan=60) == wide[:5]
    answered = sharegpt_first_turns(scan=60, answered=True)
    assert answered and all(t.answer for t in answered) and {t.id for t in answered} <= {t.id for t in wide}
    openers = sharegpt_first_turns(scan=60, continuations=False)
    assert openers and len(openers) < len(wide) and {t.id for t in openers} <= {t.id for t in wide}


def test_skip_and_scan_select_a_record_range():
    head = {t.id for t in sharegpt_first_turns(scan=20)}
    later = sharegpt_first_turns(skip=20, scan=60)
    assert later and not head & {t.id for t in later}
    assert len(sharegpt_first_turns(scan=60)) > len(later)


def test_token_bounds_count_the_chat_templated_prompt():
    tok = train_bpe(300)
    turns = sharegpt_first_turns(8, tokenizer=tok, min_tokens=20, max_tokens=120)
    assert len(turns) == 8 and turns != sharegpt_first_turns(8)  # the bounds left some turns out
    for t in turns:
        ids = tok.apply_chat_template(t.messages, add_generation_prompt=True, tokenize=True)
        n = len(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert 20 <= n <= 120


def test_humaneval_prompts_are_the_164_in_file_order():
    prompts = humaneval_prompts()
    assert len(prompts) == 164
    assert "def has_close_elements" in prompts[0] and "def " in prompts[-1]
