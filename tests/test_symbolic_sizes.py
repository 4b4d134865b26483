"""Sizes of run-time symbols (ir/symbolic.py) against plain integer arithmetic: every value of
the symbols within their bounds is tried. floor_div gives one spelling for one size (a
stride-2 conv's, two pools', a UNet's padding), and at_most proves only what holds."""
import itertools

import pytest

from modelkiln.ir.symbolic import Dim, at_most, deriving_symbols, floor_div

H = Dim.symbol("h", 1, 70)
W = Dim.symbol("w", 3, 9)


def _values(derived: dict, dims) -> list[dict]:
    """Every assignment of the free symbols in their bounds, the derived ones computed from it."""
    free = sorted({(s, lo, hi) for d in dims if isinstance(d, Dim) for s, lo, hi in d.bounds if s not in derived}
                  | {(s, lo, hi) for spec in derived.values() for s, lo, hi in spec[0].bounds if s not in derived})
    out = []
    for combo in itertools.product(*(range(lo, hi + 1) for _, lo, hi in free)):
        values = {s: v for (s, _, _), v in zip(free, combo)}
        for name, (numerator, d) in derived.items():  # (in the order they were made)
            values[name] = numerator.evaluate(values) // d
        out.append(values)
    return out


def _value(x, values: dict) -> int:
    return x.evaluate(values) if isinstance(x, Dim) else int(x)


@pytest.mark.parametrize("make,want", [
    (lambda: floor_div(H - 1, 2) + 1, lambda h, w: (h - 1) // 2 + 1),                      # a stride-2 conv
    (lambda: floor_div(floor_div(H - 2, 2) + 1 - 2, 2) + 1, lambda h, w: ((h - 2) // 2 - 1) // 2 + 1),  # two pools
    (lambda: floor_div(floor_div(H + 1, 2) - 1, 2) + 1, lambda h, w: ((h + 1) // 2 - 1) // 2 + 1),
    (lambda: floor_div(3 * H + W - 7, 4), lambda h, w: (3 * h + w - 7) // 4),
    (lambda: floor_div(floor_div(H, 2) - 2 * floor_div(H, 4), 2), lambda h, w: (h // 2 - 2 * (h // 4)) // 2),
    (lambda: floor_div(2 * H + 6, 2), lambda h, w: h + 3),
    (lambda: floor_div(4 - floor_div(W, 4) - H, 4), lambda h, w: (4 - w // 4 - h) // 4),  # below zero too
    (lambda: (4 - floor_div(H, 4) % 4) % 4, lambda h, w: (4 - (h // 4) % 4) % 4),      # a Swin's padding
    (lambda: (3 * H + 2 * W + 1) % 5, lambda h, w: (3 * h + 2 * w + 1) % 5),
])
def test_floor_div_is_the_floor_of_the_quotient_at_every_size(make, want):
    symbols, derived = {"h": (1, 70), "w": (3, 9)}, {}
    with deriving_symbols(symbols, derived):
        size = make()
    for values in _values(derived, [size, H, W]):
        assert _value(size, values) == want(values["h"], values["w"]), values


def test_one_size_has_one_spelling():
    """A stride-2 conv's ceil(h / 2) is (h + 1)//2 however written; two 2x2 pools give (h)//4,
    not a quotient of a quotient, as does h // 4 written directly; a UNet's padding, the
    difference of the skip's size and twice the deeper map's, halves to 0."""
    symbols, derived = {"h": (1, 70)}, {}
    with deriving_symbols(symbols, derived):
        assert str(floor_div(H - 1, 2) + 1) == str(floor_div(H + 1, 2)) == "(h + 1)//2"
        pooled = floor_div(floor_div(H - 2, 2) + 1 - 2, 2) + 1
        assert pooled == floor_div(H, 4) and str(pooled) == "(h)//4"
        assert floor_div(floor_div(H, 2) - 2 * floor_div(H, 4), 2) == 0
    assert sorted(derived) == ["(h + 1)//2", "(h)//2", "(h)//4"]


@pytest.mark.parametrize("make,proven", [
    (lambda: (2 * floor_div(H - 1, 2), H - 1), True),                          # a 2x upsample of a stride-2 map
    (lambda: (2 * floor_div(H + 1, 4), floor_div(H + 1, 2)), True),            # through a finer quotient
    (lambda: (floor_div(H + 1, 2), 2 * floor_div(H + 3, 4)), True),            # two stride-2 convs, doubled back
    (lambda: (0, floor_div(H, 2) - 2 * floor_div(H, 4)), True),                # a UNet's padding is no size below 0
    (lambda: (floor_div(H + 1, 2), floor_div(H, 2)), False),                   # false at odd h
    (lambda: (2 * floor_div(H + 3, 4), floor_div(H + 1, 2)), False),           # false at h = 1
])
def test_at_most_proves_what_holds_and_nothing_else(make, proven):
    symbols, derived = {"h": (1, 70)}, {}
    with deriving_symbols(symbols, derived):
        a, b = make()
        assert at_most(a, b) == proven
    holds = all(_value(a, v) <= _value(b, v) for v in _values(derived, [a, b, H]))
    assert holds or not proven  # (never proven where a value breaks it)
    assert holds == proven  # (and these cases hold exactly where they are proven)


def test_a_size_divides_by_a_polynomial_it_is_a_multiple_of():
    """A Reshape's -1 beside tokens = a*b + 1 (a ViT's patches and class token): the division
    is exact, term by term; where it is not, a SymbolError (the Reshape then runs at run time
    or is refused)."""
    from modelkiln.ir.symbolic import SymbolError
    a, b, n = Dim.symbol("a", 1, 9), Dim.symbol("b", 1, 9), Dim.symbol("n", 1, 4)
    assert (48 * a * b * n + 48 * n) // (16 * a * b + 16) == 3 * n
    assert ((a + 1) * (b + 2) * n) // (a + 1) == b * n + 2 * n
    for bad in [(48 * a * b + 47, 16 * a * b + 16), (a * a + 1, a + 1)]:
        with pytest.raises(SymbolError):
            bad[0] // bad[1]


@pytest.mark.parametrize("op,a,b,want", [
    ("Equal", H, -1, False), ("Equal", H + 1, 0, False), ("Equal", H, 5, None),
    ("Less", -1, H, True), ("GreaterOrEqual", H, 1, True), ("Greater", H, 70, False), ("LessOrEqual", H, 35, None),
])
def test_sizes_are_compared_where_their_bounds_decide(op, a, b, want):
    """An exporter's Equal(shape, -1) (TorchScript's expand(batch, -1, -1)) is False for any
    size; a comparison the bounds do not decide is left to run time (None)."""
    from modelkiln.ir.ops.inference import _decide
    assert _decide(op, a, b) == want


def test_run_time_extents_agree_in_python_and_in_the_entrys_c(tmp_path):
    """A loop extent over the symbols (what a kernel's planes and row tails are sized by: min,
    max, division, remainder) has one value, whether the driver computes it (thread plans,
    at the bounds) or the module's C entry does (at run time)."""
    import subprocess

    from modelkiln.ir.loop import SYMBOLS, Const, Load, add, div, fbin, mul, rem, sub
    from modelkiln.ir.loop import extent_c, extent_value
    h, w = Load(SYMBOLS, Const(0)), Load(SYMBOLS, Const(1))
    extents = [fbin("max", add(w, 2), add(mul(h, 2), 1)), fbin("min", div(add(w, 1), 2), sub(h, 1)),
               mul(fbin("max", sub(w, h), 0), rem(h, 3)), div(fbin("min", add(h, 3), fbin("max", w, 4)), 2)]
    program = tmp_path / "extents.c"
    program.write_text("#include <stdio.h>\n#include <stdlib.h>\nint main(int argc, char** argv) {\n"
                       "  long long dims[2] = {atoll(argv[1]), atoll(argv[2])};\n"
                       + "".join(f'  printf("%lld\\n", (long long)({extent_c(e)}));\n' for e in extents) + "}\n")
    subprocess.run(["cc", "-o", str(tmp_path / "extents"), str(program)], check=True)
    for values in ((1, 1), (7, 3), (2, 40), (33, 33), (5, 6)):
        out = subprocess.run([str(tmp_path / "extents"), *map(str, values)], check=True, capture_output=True, text=True)
        assert [int(v) for v in out.stdout.split()] == [extent_value(e, list(values)) for e in extents], values
