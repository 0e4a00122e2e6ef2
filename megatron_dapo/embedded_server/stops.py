"""Stop strings and stop regexes: where SGLang 0.5.23 looks for them, matched at a cost linear in the text.

Where (SGLang's `Req.tail_str` and `_check_str_based_finish`, `srt/managers/schedule_batch.py`): after
each decode step only the last `window` output tokens are decoded and searched, window = 1 + the
longest stop string in tokens (`tokenizer.encode(s, add_special_tokens=False)`) or 1 + the longest text
a stop regex can match in characters (unbounded for `+`, `*`, `{n,}`: then the whole output). A stop
string is found with `in`, a regex with a search. The request ends with the token that completed the
match (output_ids keep it), finish_reason `{"type": "stop", "matched": <stop string or pattern>}`.
Text (SGLang's detokenizer `trim_matched_stop`): cut before the first occurrence of the matched string
(through it with no_stop_trim); for a regex that string is the pattern itself, so the text is cut only
where the pattern's own characters occur in it. A stop token's text is left out unless no_stop_trim.

Cost: patterns are compiled with RE2 (google-re2), whose search is linear in the text. Python's `re`
backtracks: `([\\s\\S]+)+\\x00` over 64 characters runs for ages while holding the GIL, which freezes
every thread of the server. Patterns RE2 cannot compile (backreferences, lookaround) are refused when
the request is parsed (400 naming stop_regex), as are patterns over SGLang's limits (256 bytes, 32 of
them).
"""

from __future__ import annotations

import re._parser as sre_parse

import re2

MAX_STOP_REGEX_BYTES = 256  # SGLang 0.5.23's MAX_STOP_REGEX_LEN
MAX_STOP_REGEX_COUNT = 32  # SGLang 0.5.23's MAX_STOP_REGEX_COUNT
UNBOUNDED = 1 << 30  # the length SGLang assigns a regex part with no upper bound

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # the error goes back to the client, not to the server's stderr


def compile_stop_regex(pattern: str):
    """`pattern` compiled by RE2; ValueError saying why not (too long, or outside RE2's syntax)."""
    size = len(pattern.encode("utf-8"))
    if size > MAX_STOP_REGEX_BYTES:
        raise ValueError(f"pattern of {size} bytes is over the {MAX_STOP_REGEX_BYTES}-byte limit")
    try:
        return re2.compile(pattern, options=_RE2_OPTIONS)
    except re2.error as e:
        why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(
            f"invalid regular expression {pattern!r} for RE2 ({why}); backreferences and lookaround are not supported"
        ) from e


def regex_max_chars(pattern: str) -> int:
    """An upper bound on the characters a match of `pattern` spans, counted as SGLang 0.5.23 counts
    (`get_max_seq_length` over Python's regex parse): one per literal, class or `.`, the longest
    branch, repeat bound x body, zero for anchors, UNBOUNDED for an open repeat and for anything else
    (a negated literal, a lookaround, a syntax only RE2 knows)."""
    try:
        return _parsed_max_chars(sre_parse.parse(pattern))
    except (sre_parse.error, RecursionError):
        return UNBOUNDED


def _parsed_max_chars(parsed) -> int:
    total = 0
    for op, arg in parsed:
        if op in (sre_parse.LITERAL, sre_parse.IN, sre_parse.ANY):
            total += 1
        elif op is sre_parse.SUBPATTERN:
            total += _parsed_max_chars(arg[-1])
        elif op is sre_parse.BRANCH:
            total += max(_parsed_max_chars(b) for b in arg[1])
        elif op in (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT):
            hi, body = arg[1], arg[2]
            total += UNBOUNDED if hi == sre_parse.MAXREPEAT else hi * _parsed_max_chars(body)
        elif op is not sre_parse.AT:
            total += UNBOUNDED
    return total


def stop_window(tokenizer, stop_strs: tuple[str, ...], stop_regex: tuple[str, ...]) -> int:
    """How many trailing output tokens SGLang decodes to look for the stops (0: no stops)."""
    if not stop_strs and not stop_regex:
        return 0
    longest_str = max((len(tokenizer.encode(s, add_special_tokens=False)) for s in stop_strs), default=0)
    longest_regex = max((regex_max_chars(p) for p in stop_regex), default=0)
    return max(longest_str, longest_regex) + 1


class StopMatcher:
    """One request's stop strings and regexes, checked after each new token."""

    def __init__(self, tokenizer, stop_strs: tuple[str, ...], stop_regex: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.strs = stop_strs
        self.regexes = [(p, compile_stop_regex(p)) for p in stop_regex]
        self.window = stop_window(tokenizer, stop_strs, stop_regex)

    def matched(self, output: list[int]) -> str | None:
        """The stop string or pattern that the output's tail window holds (strings first), or None."""
        if not self.window or not output:
            return None
        tail = self.tokenizer.decode(output[-self.window :])
        for s in self.strs:
            if s in tail:
                return s
        for pattern, regex in self.regexes:
            if regex.search(tail):
                return pattern
        return None


def trim_stop_text(text: str, matched, no_stop_trim: bool) -> str:
    """The answer text of a request that stopped on string/pattern `matched`: cut at its first
    occurrence (before it, or after it with no_stop_trim); unchanged where it does not occur."""
    if not isinstance(matched, str) or (pos := text.find(matched)) < 0:
        return text
    return text[: pos + len(matched)] if no_stop_trim else text[:pos]
