"""The DAPO math rule: the answer is on the last `Answer:` line; +1 if it matches, else -1.

Behaviour follows the DAPO recipe's rule (verl `utils/reward_score/math_dapo.py`, Minerva
normalisation): only the last 300 characters of the response are read, the answer is the text
after the last `Answer:` (case-insensitive) up to the end of its line, and both answer and
ground truth are normalised the same way before an exact string comparison.
"""

from __future__ import annotations

import re

# Only the tail is judged: the longest MATH-500 answer is 159 characters, and a long
# response must not make the regex below expensive.
TAIL_CHARS = 300
ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
INVALID = "[INVALID]"

# Plain-text rewrites applied in this order (articles, spaces, dollar signs, "and" lists).
_REWRITES = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# Units and decorations that never change the value.
_DROPPED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    r"\mathrm{th}",
    r"^\circ",
    r"^{\circ}",
    r"\;",
    r",\!",
    "{,}",
    '"',
    "\\dots",
)
# Wrappers whose content is the answer, then TeX shorthands (\fracab, \sqrta).
_UNWRAP = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),
)


def normalize_answer(text: str) -> str:
    """Canonical form of a final answer: `x = 1,000 dollars` and `1000` both become `1000`."""
    text = text.split("=")[-1]
    for old, new in _REWRITES:
        text = text.replace(old, new)
    for junk in _DROPPED:
        text = text.replace(junk, "")
    for pattern, repl in _UNWRAP:
        text = pattern.sub(repl, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def extract_answer(response: str) -> str:
    """The normalised text after the last `Answer:` in the response's tail, or INVALID."""
    found = ANSWER_RE.findall(response[-TAIL_CHARS:])
    return normalize_answer(found[-1]) if found else INVALID


def compute_score(response: str, ground_truth: str) -> dict:
    """{"score": +1.0 or -1.0, "acc": bool, "pred": normalised prediction}."""
    pred = extract_answer(response)
    correct = pred == normalize_answer(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
