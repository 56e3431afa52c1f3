"""Which `vllm serve` flag each argument of a command line lands on, read the way vLLM reads it.

`vllm_resolver()` gives a `Resolver`; it resolves against the full list of `vllm serve` option strings
(`vllm_serve_options.json`). vLLM's rewrite and argparse's prefixes: docs/architecture.md, "Reading `vllm
serve` arguments".
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

OPTIONS_FILE = "vllm_serve_options.json"

# argparse's own test for "looks like a negative number" (its `_negative_number_matcher`).
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
# `vllm serve` looks for these in every argument, even after `--` or where another flag takes a value.
_MODEL_FLAG = re.compile(r"^--model(=.+|$)")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """The option strings of `vllm serve`, in the order its parser registers them."""

    vllm_version: str
    actions: tuple[tuple[str, ...], ...]  # each action's option strings, as argparse holds them

    @property
    def canonical(self) -> dict[str, str]:
        """Option string -> the flag it belongs to: the action's first long option string
        (`-tp` -> `--tensor-parallel-size`, `--no-enable-prefix-caching` -> `--enable-prefix-caching`)."""
        out: dict[str, str] = {}
        for strings in self.actions:
            name = next((s for s in strings if s.startswith("--")), strings[0])
            for s in strings:
                out.setdefault(s, name)
        return out

    @classmethod
    def from_json(cls, text: str) -> ServeOptions:
        body: dict[str, Any] = json.loads(text)
        return cls(str(body["vllmVersion"]), tuple(tuple(str(s) for s in a) for a in body["actions"]))


@cache
def serve_options() -> ServeOptions:
    """The committed list of `vllm serve` option strings."""
    return ServeOptions.from_json(resources.files("kvpilot.api").joinpath(OPTIONS_FILE).read_text())


@dataclass(frozen=True, slots=True)
class FlagUse:
    """One argument vLLM reads as a flag (or tries to): `flag` is the flag it sets, None when it
    matches no flag (`matches` then lists the flags an ambiguous prefix could be, in vLLM's order)."""

    index: int  # position in the argument list given
    arg: str  # as given
    seen: str  # as argparse sees it, after vLLM's rewrite (what its error messages quote)
    option: str | None = None  # the option string it matched (`-tp`, `--no-enable-prefix-caching`)
    flag: str | None = None  # that option's flag (`--tensor-parallel-size`)
    matches: tuple[str, ...] = ()

    @property
    def ambiguous(self) -> bool:
        return len(self.matches) > 1

    @property
    def ambiguity(self) -> str:
        """vLLM's (argparse's) own error for an ambiguous prefix."""
        return f"ambiguous option: {self.seen} could match {', '.join(self.matches)}"


class Resolver:
    """Resolves arguments against a set of option strings (registration order kept for messages)."""

    def __init__(self, option_strings: Iterable[str], canonical: dict[str, str]) -> None:
        self._order = {s: i for i, s in enumerate(dict.fromkeys(option_strings))}
        self._sorted = sorted(self._order)
        self._canonical = canonical
        # argparse reads `-1` as a flag only when some option string looks like a negative number.
        self._negative_optionals = any(_NEGATIVE_NUMBER.match(s) for s in self._order)

    def _prefixed(self, prefix: str) -> list[str]:
        """The option strings that start with `prefix` (a contiguous run of the sorted list)."""
        lo = bisect.bisect_left(self._sorted, prefix)
        out = []
        for s in self._sorted[lo:]:
            if not s.startswith(prefix):
                break
            out.append(s)
        return out

    def classify(self, token: str) -> tuple[str | None, tuple[str, ...]] | None:
        """None if argparse reads `token` as positional; else (the option string, ()) when it names
        one flag, (None, matches) for an ambiguous prefix, (None, ()) for an unknown flag."""
        if not token or token[0] != "-":
            return None
        if token in self._order:
            return token, ()
        if len(token) == 1:
            return None
        name, sep, _ = token.partition("=")
        if sep and name in self._order:
            return name, ()
        if token[1] == "-":
            found = self._prefixed(name)
        else:
            # `-x...`: `-x` itself with the rest as its value, or a prefix of a single-dash option;
            # 3.11 takes the whole token as the prefix, 3.12+ the part before `=`.
            short = [token[:2]] if token[:2] in self._order else []
            found = short + self._prefixed(token) + self._prefixed(name)
        matches = tuple(sorted(dict.fromkeys(found), key=self._order.__getitem__))
        if len(matches) == 1:
            return matches[0], ()
        if matches:
            return None, matches
        if _NEGATIVE_NUMBER.match(token) and not self._negative_optionals:
            return None
        if " " in token:
            return None
        return None, ()

    def resolve(self, args: Sequence[str]) -> list[FlagUse]:
        """Every argument of `args` (the arguments after `vllm serve`) that vLLM reads as a flag."""
        # Before anything else, vLLM replaces `--config FILE` by the flags in FILE and moves the value of
        # `--model X` / `--model=X` to the model's place, wherever those arguments stand.
        early = {i: FlagUse(i, a, a, a.partition("=")[0], a.partition("=")[0]) for i, a in enumerate(args)
                 if a == "--config" or _MODEL_FLAG.match(a)}
        tokens = _rewrite(args)
        # vLLM's dotted JSON-flag fields: `--name.key[+][=V]` leaves its place (with its value, the next
        # argument, when there is no `=`) and `--name` is appended at the end.
        dropped: set[int] = set()
        dotted: list[tuple[int, str, str]] = []  # (index in args, argument, --name)
        for i, (origin, token) in enumerate(tokens):
            if i in dropped or (token.startswith("--") and "." not in token):
                continue
            if token.startswith("-") and "." in token:
                name, sep, _ = token.partition("=")
                if sep and "." not in name:
                    continue  # the dot was in the value only
                if not sep:
                    dropped.add(i + 1)
                dropped.add(i)
                dotted.append((origin, args[origin], name.removesuffix("+").split(".")[0]))
        kept = [(origin, args[origin], token) for i, (origin, token) in enumerate(tokens) if i not in dropped]
        kept += dotted
        uses = list(early.values())
        for origin, arg, token in kept:
            if token == "--":
                break  # argparse: everything after is positional (the appended JSON flags too)
            if origin in early:
                continue
            found = self.classify(token)
            if found is None:
                continue
            option, matches = found
            flag = self._canonical.get(option, option) if option else None
            uses.append(FlagUse(origin, arg, token, option, flag, matches))
        return sorted(uses, key=lambda u: u.index)


def _rewrite(args: Sequence[str]) -> list[tuple[int, str]]:
    """FlexibleArgumentParser's rewrite of each argument, as (index of the argument it came from, token)."""
    out: list[tuple[int, str]] = []
    for i, arg in enumerate(args):
        if arg.startswith("--help="):
            out.append((i, "--help"))
        elif arg.startswith("--"):
            key, sep, value = arg.partition("=")
            head, dot, tail = key[2:].partition(".")
            out.append((i, "--" + head.replace("_", "-") + dot + tail + sep + value))
        elif arg.startswith("-O") and arg != "-O":
            out += [(i, "--optimization-level"), (i, arg[3:] if arg[2] == "=" else arg[2:])]
        elif arg == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
            out.append((i, "--optimization-level"))
        else:
            out.append((i, arg))
    return out


@cache
def vllm_resolver(extra: tuple[str, ...] = ()) -> Resolver:
    """A resolver over `vllm serve`'s option strings plus `extra` (flags kvpilot renders, which the
    vLLM it runs therefore has even where the committed list is older)."""
    opts = serve_options()
    strings = [s for a in opts.actions for s in a]
    canonical = opts.canonical
    for s in extra:
        canonical.setdefault(s, s)
    return Resolver([*strings, *extra], canonical)
