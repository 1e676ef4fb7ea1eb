"""The domain of a ShareGPT prompt (code, math, writing, chat), by rules on its first user turn.

Rules, first match wins (a request to write code is code; a story that mentions 2 + 2 is writing):

1. code: a code fence (```), or a programming keyword: a language or tool name (python, javascript, sql, c++, c#,
   f#, ...), or a code construct (`def f(`, `function f(`, `import x`, `#include`, `SELECT ... FROM`, `console.log`,
   ...).
2. writing: a request to write or draft a text: (write|compose|draft|create|generate) ... (essay|story|poem|email|
   letter|article|blog|script|song|speech|summary|outline|post|tweet|...), or rewrite / paraphrase / proofread.
3. math: an arithmetic expression (`12 * 7`, `3x+2=11`, `x^2`, `12 - 7`; a bare `2-3` is a range) or a math word:
   solve, calculate, compute, equation, integral, derivative, probability, algebra, geometry, theorem, ...
4. chat: everything else.

Keyword rules, not a classifier: cheap, deterministic and readable. They err on mixed prompts (a story about a
mathematician is writing unless it asks to calculate something); the suite needs sets that lean to one domain, not
perfect labels.
"""

from __future__ import annotations

import re

DOMAINS = ("code", "math", "writing", "chat")

# The keywords end in (?!\w), not \b: after "c++" or "c#" a \b needs a word character next, so "c++ code" or
# "in C#?" would miss. "c++17" / "c++20" count too.
_CODE = re.compile(
    r"```|#include\b|\bdef \w+\(|\bfunction \w*\s*\(|\bconsole\.log\b|\bimport \w+|\bpublic static\b"
    r"|\bSELECT\b.+\bFROM\b|=>|\b(python|javascript|typescript|java|c\+\+(\d\d)?|c#|f#|golang|rust|kotlin|swift|"
    r"php|ruby|html|css|sql|bash|powershell|regex|json|yaml|api|react|node\.?js|django|flask|pandas|numpy|docker|"
    r"kubernetes|git|code|coding|script in|compile|debug|algorithm)(?!\w)",
    re.IGNORECASE | re.DOTALL)
# `12 * 7`, `3x+2=11`, `x^2`, `12 - 7` (a bare `2-3` is a range, not arithmetic)
_ARITHMETIC = re.compile(r"[\dxyn]\s*[+*/^=×÷]\s*\(?\s*-?\d|\d\s+-\s+\d")
_MATH_WORDS = re.compile(
    r"\b(solve|calculate|compute|equation|integral|derivative|probability|percent(age)?|arithmetic|algebra|"
    r"geometry|theorem|matrix|polynomial)\b", re.IGNORECASE)
_WRITING = re.compile(
    r"\b(write|compose|draft|create|generate)\b.{0,60}\b(essay|story|poem|email|e-mail|letter|article|blog|script|"
    r"song|lyrics|speech|summary|outline|post|tweet|caption|description|report|paragraph|review)s?\b"
    r"|\b(rewrite|paraphrase|proofread|rephrase)\b", re.IGNORECASE | re.DOTALL)


def tag_domain(text: str) -> str:
    """One of DOMAINS for a first user turn (rules in the module docstring, first match wins)."""
    if _CODE.search(text):
        return "code"
    if _WRITING.search(text):
        return "writing"
    if _ARITHMETIC.search(text) or _MATH_WORDS.search(text):
        return "math"
    return "chat"
