"""The domain rule (eval/harness/domains.py) on language names that end in a symbol: C++, C#, F#."""

from __future__ import annotations

import pytest

from eval.harness.domains import tag_domain


@pytest.mark.parametrize("text", [
    "How do I read a file line by line in C++?",
    "Write a C++ function that reverses a linked list",
    "What does the ?? operator do in C#",
    "Is C# or Java faster for a game server?",
    "Is F# a good choice for finance?",
    "Which C++17 features should I learn first?",
])
def test_languages_that_end_in_a_symbol_are_code(text):
    assert tag_domain(text) == "code"


@pytest.mark.parametrize("text", [
    "Recommend some Javanese dishes",  # "java" inside a longer word is not the language
    "Who bought the Codex Leicester?",  # nor is "code"
])
def test_a_keyword_inside_a_longer_word_is_not_code(text):
    assert tag_domain(text) == "chat"
