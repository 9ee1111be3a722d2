"""The chat prompt set (tandem/loadgen/chat_prompts.py): seeded, its train and test splits disjoint
in wording and topic, and rendered through a tokenizer's chat template."""

from __future__ import annotations

import re

import pytest

from tandem.loadgen import chat_prompts as cp


def test_splits_share_no_message_template_or_subject() -> None:
    train = set(cp.chat_messages(3000, seed=0, split="train"))
    test = set(cp.chat_messages(300, seed=0, split="test"))
    assert len(train) > 1500 and len(test) > 100
    assert not train & test
    for template in cp._split(cp._GENERAL_TEMPLATES, "test", 4):
        prefix = template.split("{s}")[0]
        assert not any(m.startswith(prefix) and m.endswith(template.split("{s}")[1]) for m in train)
    train_subjects = cp._split(cp._SUBJECTS, "train", 5)
    for subject in cp._split(cp._SUBJECTS, "test", 5):
        # A train subject may contain a test one's words ("the moon" in "the Moon landing" does not
        # match: case), so a test subject must not appear except inside a train subject.
        word = re.compile(rf"\b{re.escape(subject)}\b")
        for m in train:
            if word.search(m):
                assert any(subject in t and t in m for t in train_subjects if t != subject), m


def test_seeded_and_a_quarter_programming() -> None:
    a = cp.chat_messages(40, seed=3)
    assert a == cp.chat_messages(40, seed=3) and a != cp.chat_messages(40, seed=4)
    code_tasks = set(cp._CODE_TASKS)
    coding = [m for m in a if any(t in m for t in code_tasks)]
    assert len(coding) == 10
    with pytest.raises(ValueError, match="split"):
        cp.chat_messages(4, split="validation")


def test_rendered_through_the_chat_template(tokenizer_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        cp.chat_prompt_ids(tok, ["hi"])
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    (ids,) = cp.chat_prompt_ids(tok, ["What is rain?"])
    text = tok.decode(ids)
    assert text.startswith("[user]") and "rain" in text and text.rstrip().endswith("[assistant]")
