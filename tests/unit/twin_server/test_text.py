"""Token counting and one-token text pieces."""

from __future__ import annotations

import itertools

from kvpilot.twin import text


def test_count_text_tokens_words_punctuation_and_long_words():
    assert text.count_text_tokens("") == 0
    assert text.count_text_tokens("the cat sat") == 3
    assert text.count_text_tokens("Hello, world!") == 4
    # a 13-character word is three pieces of at most six characters
    assert text.count_text_tokens("international") == 3
    assert text.count_text_tokens("snake_case") == 3  # snake, _, case


def test_prompt_and_chat_counts_add_the_template_tokens():
    assert text.count_prompt_tokens("") == 1
    assert text.count_prompt_tokens("a b") == 3
    one = text.count_chat_tokens(["a b"])
    assert one == 1 + text.CHAT_TOKENS_REPLY_PRIMER + text.CHAT_TOKENS_PER_MESSAGE + 2
    assert text.count_chat_tokens(["a b", "c"]) == one + text.CHAT_TOKENS_PER_MESSAGE + 1


def test_output_pieces_are_deterministic_short_words_with_a_leading_space():
    a = list(itertools.islice(text.output_pieces(1234), 50))
    b = list(itertools.islice(text.output_pieces(1234), 50))
    c = list(itertools.islice(text.output_pieces(4321), 50))
    assert a == b and a != c
    for piece in a:
        assert piece.startswith(" ") and piece[1:].isalpha() and len(piece) <= 6
        # one piece is one token for the twin's own counter, too
        assert text.count_text_tokens(piece) == 1


def test_prompt_seed_is_stable_across_processes():
    # crc32, not hash(): a fixed value, whatever PYTHONHASHSEED is
    assert text.prompt_seed("hello") == 907060870


def test_natural_output_length_in_range_and_deterministic():
    lengths = [text.natural_output_length(s) for s in range(200)]
    assert all(16 <= n <= 512 for n in lengths)
    assert lengths == [text.natural_output_length(s) for s in range(200)]
    assert len(set(lengths)) > 50
