"""Token counting and token text for the twin's HTTP server.

The twin has no model and no tokenizer, but clients of an OpenAI-compatible server count
tokens themselves (benchmark tools re-tokenize the streamed text), so the server must:

* count prompt tokens deterministically from the text, at roughly the rate a BPE tokenizer
  does for English (about 1.3 tokens per word); and
* emit text pieces that are ONE token each in common tokenizers: a short, frequent English
  word with a leading space (" the", " of", ...) is a single token in cl100k, Llama-3 and
  Mistral vocabularies alike.

Everything here is a pure function of its input: the same prompt gives the same count and the
same output text on every run.
"""

from __future__ import annotations

import math
import random
import re
import zlib
from collections.abc import Iterable, Iterator

# A word piece: a run of letters/digits, or one other visible character.
_PIECE = re.compile(r"[^\W_]+|[^\w\s]|_")
# BPE vocabularies hold most short words whole and split longer ones into ~4-6 character pieces.
_CHARS_PER_TOKEN = 6
_LONG_RUN = re.compile(rf"[^\W_]{{{_CHARS_PER_TOKEN + 1},}}")
_NOT_ALNUM = re.compile(r"[\W_]")
# Text is counted this many characters at a time: each regex call holds the GIL, and a server that
# counts a megabytes-long prompt in a worker thread must let its event loop run in between.
_CHUNK = 1 << 16

# Tokens the chat template adds around every message (role header, separators) and once for
# the assistant's reply header.  OpenAI's own estimate for its chat format uses the same figures.
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_TOKENS_REPLY_PRIMER = 3

# One token each (with the leading space) in cl100k_base, Llama-3 and Mistral tokenizers.
OUTPUT_WORDS: tuple[str, ...] = (
    " the", " of", " and", " to", " in", " a", " is", " that", " for", " it", " as", " was",
    " with", " be", " by", " on", " not", " he", " this", " are", " or", " his", " from", " at",
    " which", " but", " have", " an", " had", " they", " you", " were", " their", " one", " all",
    " we", " can", " her", " has", " there", " been", " if", " more", " when", " will", " would",
    " who", " so", " no", " time", " about", " up", " out", " said", " what", " some", " into",
    " them", " its", " other", " than", " then", " only", " new",
)


def count_text_tokens(text: str, stop_after: int | None = None) -> int:
    """Tokens in `text` without any special token: one per short word or punctuation mark,
    more for long words (one per started `_CHARS_PER_TOKEN` characters).

    With `stop_after`, counting stops once the count passes it (a server refusing a prompt that
    long need not count megabytes of it): a result above `stop_after` is a lower bound."""
    # Each piece is one token plus one per further started group of characters:
    # max(1, ceil(n / 6)) == 1 + (n - 1) // 6.
    total = 0
    start, end = 0, len(text)
    while start < end:
        stop = min(start + _CHUNK, end)
        if stop < end and _is_alnum(text[stop - 1]) and _is_alnum(text[stop]):
            # Never cut a word in two: move the cut to the end of the word.
            after = _NOT_ALNUM.search(text, stop)
            stop = after.start() if after is not None else end
        chunk = text[start:stop]
        total += len(_PIECE.findall(chunk))
        for run in _LONG_RUN.findall(chunk):
            total += (len(run) - 1) // _CHARS_PER_TOKEN
        start = stop
        if stop_after is not None and total > stop_after:
            break
    return total


def _is_alnum(ch: str) -> bool:
    return _NOT_ALNUM.match(ch) is None and not ch.isspace()


def count_prompt_tokens(text: str, stop_after: int | None = None) -> int:
    """Tokens of a completion prompt: its text plus the beginning-of-sequence token that
    Llama-style tokenizers prepend (so an empty prompt is one token, as in vLLM)."""
    return 1 + count_text_tokens(text, None if stop_after is None else stop_after - 1)


def count_chat_tokens(contents: Iterable[str], stop_after: int | None = None) -> int:
    """Tokens of a chat prompt after the chat template: BOS, each message's text plus its
    per-message overhead, and the assistant reply header."""
    total = 1 + CHAT_TOKENS_REPLY_PRIMER
    for content in contents:
        left = None if stop_after is None else stop_after - total - CHAT_TOKENS_PER_MESSAGE
        total += CHAT_TOKENS_PER_MESSAGE + count_text_tokens(content, left)
        if stop_after is not None and total > stop_after:
            break
    return total


def prompt_seed(text: str) -> int:
    """A stable 32-bit seed for a prompt (zlib's CRC, unlike hash(), does not change per process)."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


def output_pieces(seed: int) -> Iterator[str]:
    """An endless, deterministic stream of one-token text pieces for a request."""
    rng = random.Random(seed)
    words = OUTPUT_WORDS
    while True:
        yield words[rng.randrange(len(words))]


def natural_output_length(seed: int, low: int = 16, high: int = 512) -> int:
    """How many tokens the "model" would write before its end-of-sequence token.

    Real models stop on their own unless the client sends `ignore_eos`; the twin draws that
    length from the prompt's seed, log-uniform in [low, high] (short answers are common)."""
    rng = random.Random(seed ^ 0x5EED)
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))
