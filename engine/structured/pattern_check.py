"""Refuse `pattern` regexes that xgrammar 0.2.9 would ignore in part or compile too slowly.

xgrammar skips lookaheads `(?=...)` / `(?!...)` (with a warning only), so the output may break
them; it refuses lookbehinds, backreferences and `\\b` itself. It builds an automaton with one
copy of each atom per counted repetition, before it can be stopped (a compile cannot be
interrupted): `.{0,1000}` takes ~0.3 s on a 49k-token vocabulary, `.{0,5000}` 8 s; a repeated
group with optional or repeated parts blows up much sooner: `(.{0,6}.){0,6}` 2.3 s,
`(.{0,15}.){0,15}` 43 s. So the unrolled size is capped (MAX_UNROLLED atoms), and a group with
a quantifier inside may be counted only up to MAX_NESTED atoms (`(\\d{1,3}\\.){3}` is 12).
"""

from __future__ import annotations

import re

MAX_UNROLLED = 1000
MAX_NESTED = 16
_LOOKAHEAD = re.compile(r"(?<!\\)\(\?[=!]")
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def pattern_problem(pattern: str) -> str | None:
    """Why xgrammar would not enforce `pattern` quickly and exactly; None if it would."""
    if _LOOKAHEAD.search(pattern):
        return "lookahead (?= / (?!) is ignored by xgrammar"
    try:
        unrolled = _unrolled_size(pattern)
    except OverflowError as e:
        return str(e)
    if unrolled > MAX_UNROLLED:
        return (f"its counted repetitions unroll to {unrolled} characters, "
                f"over the {MAX_UNROLLED} xgrammar compiles quickly")
    return None


def _unrolled_size(pattern: str) -> int:
    """Atoms in the pattern with each counted repetition unrolled. A frame is a group being read:
    [atom sizes, whether it has a quantifier]; each atom is [size, whether it has one inside]."""
    frames: list[list] = [[[], False]]
    i = 0
    while i < len(pattern):
        ch, atoms = pattern[i], frames[-1][0]
        count = _COUNT.match(pattern, i) if ch == "{" else None
        if ch == "\\":
            atoms.append([1, False])
            i += 1
        elif ch == "[":
            i = _class_end(pattern, i)
            atoms.append([1, False])
        elif ch == "(":
            if pattern.startswith("?", i + 1):  # (?:  (?P<name>  (?<name>  or a flag group (?i)
                while i < len(pattern) and pattern[i] not in ":>)":
                    i += 1
                if pattern[i:i + 1] == ")":
                    i += 1
                    continue
            frames.append([[], False])
        elif ch == ")" and len(frames) > 1:
            group_atoms, quantified = frames.pop()
            frames[-1][0].append([sum(a[0] for a in group_atoms), quantified])
        elif ch in "?*+" or count:
            frames[-1][1] = True
            if count and atoms:
                times = max(int(count[1]), int(count[2] or count[1]))
                atoms[-1][0] *= times
                if atoms[-1][1] and times > 1 and atoms[-1][0] > MAX_NESTED:
                    raise OverflowError(f"a group with a quantifier inside is repeated to {atoms[-1][0]} "
                                        f"characters, over the {MAX_NESTED} xgrammar compiles quickly")
                i = count.end() - 1
        elif ch not in "|^$":  # alternatives add up; anchors are no characters
            atoms.append([1, False])
        i += 1
    return sum(sum(a[0] for a in frame[0]) for frame in frames)


def _class_end(pattern: str, i: int) -> int:
    """The index of the `]` closing the character class that opens at `i`."""
    i += 2 if pattern.startswith("[^", i) else 1
    if pattern.startswith("]", i):  # a leading ] is a literal
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i
