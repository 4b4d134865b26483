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
