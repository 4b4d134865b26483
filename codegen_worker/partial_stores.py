"""Masked stores of a constant first-lanes mask, rewritten as plain stores of those lanes.

LLVM's loop vectorizer ends a predicated loop (a conv tile's write-back down 6 pixels, a
ragged row's remainder) with `llvm.masked.store` under a constant mask. Targets with mask
registers (AVX-512) store that in one instruction. AVX2 has only vmaskmovps, which AMD cores
run as a slow microcoded sequence (on Zen 5, a 3-channel stem conv's write-back of 6-pixel
columns took 0.51 ms masked, 0.33 in plain pieces), and NEON has no masked store at all (LLVM
stores lane by lane behind branches). The first `count` lanes of a vector are the same bytes
as a few plain stores of power-of-two pieces: 6 = 4 + 2, 7 = 4 + 2 + 1.

Works on the optimized module's text, between optimization and code generation: only calls
whose stored value is a named value and whose mask is a literal run of `true` then `false`
are rewritten; anything else is left masked.
"""
from __future__ import annotations

import math
import re

# (LLVM 22 prints the alignment as the pointer's attribute; older releases as an i32 operand)
_MASKED_STORE = re.compile(
    r"(?:(?:tail|notail|musttail) )?call void @llvm\.masked\.store\.v(?P<lanes>\d+)(?:f32|i32|i8|i16|f64|i64)\.p0\("
    r"<(?P=lanes) x (?P<elt>float|i32|i8|i16|double|i64)> (?P<value>%[-\w.$]+), "
    r"ptr (?:align (?P<align>\d+) )?(?P<ptr>%[-\w.$]+), (?:i32 (?P<operand_align>\d+), )?"
    r"<(?P=lanes) x i1> <(?P<mask>[^>]*)>\)[^\n]*")
_BYTES = {"float": 4, "i32": 4, "i8": 1, "i16": 2, "double": 8, "i64": 8}


def _prefix_count(mask: str, lanes: int) -> int | None:
    """How many leading lanes a literal mask enables, or None where it is not such a prefix."""
    bits = [m.strip() for m in mask.split(",")]
    if len(bits) != lanes or any(b not in ("i1 true", "i1 false") for b in bits):
        return None
    count = bits.count("i1 true")
    return count if bits[:count] == ["i1 true"] * count and 0 < count < lanes else None


def split_prefix_masked_stores(text: str) -> tuple[str, int]:
    """(text with every prefix-masked store as plain stores, how many were rewritten)."""
    rewritten = 0

    def plain(match: re.Match) -> str:
        nonlocal rewritten
        lanes, elt = int(match["lanes"]), match["elt"]
        count = _prefix_count(match["mask"], lanes)
        if count is None:
            return match[0]
        rewritten += 1
        tag, value, ptr = f"%kiln.ps{rewritten}", match["value"], match["ptr"]
        align = int(match["align"] or match["operand_align"] or 1)
        lines, first, size = [], 0, 1 << (count.bit_length() - 1)
        while first < count:
            if count - first >= size:
                at, at_align = ptr, math.gcd(align, first * _BYTES[elt]) if first else align
                if first:
                    at = f"{tag}.p{first}"
                    lines.append(f"{at} = getelementptr inbounds {elt}, ptr {ptr}, i64 {first}")
                piece = f"{tag}.v{first}"
                if size == 1:
                    lines.append(f"{piece} = extractelement <{lanes} x {elt}> {value}, i64 {first}")
                    lines.append(f"store {elt} {piece}, ptr {at}, align {at_align}")
                else:
                    picks = ", ".join(f"i32 {first + i}" for i in range(size))
                    lines.append(f"{piece} = shufflevector <{lanes} x {elt}> {value}, <{lanes} x {elt}> poison, "
                                 f"<{size} x i32> <{picks}>")
                    lines.append(f"store <{size} x {elt}> {piece}, ptr {at}, align {at_align}")
                first += size
            size //= 2
        return "\n  ".join(lines)

    return _MASKED_STORE.sub(plain, text), rewritten
