"""The arena planner never lets two live buffers share bytes, and does reuse dead ones."""
import numpy as np

from modelkiln.artifacts.memory_plan import plan_arena


def _random_buffers(rng, most: int, longest: int) -> tuple[dict, dict]:
    """(lifetimes, sizes) of up to `most` buffers living up to `longest` steps more."""
    lifetimes, sizes = {}, {}
    for i in range(int(rng.integers(1, most))):
        a = int(rng.integers(0, 20))
        lifetimes[f"t{i}"] = (a, a + int(rng.integers(0, longest)))
        sizes[f"t{i}"] = int(rng.integers(1, 5000))
    return lifetimes, sizes


def _assert_live_ones_apart(lifetimes: dict, offsets: dict, sizes: dict, note=None) -> None:
    names = list(lifetimes)
    for i, p in enumerate(names):
        assert offsets[p] % 64 == 0
        for q in names[i + 1:]:
            live_together = lifetimes[p][0] <= lifetimes[q][1] and lifetimes[q][0] <= lifetimes[p][1]
            apart = offsets[p] + sizes[p] <= offsets[q] or offsets[q] + sizes[q] <= offsets[p]
            assert apart or not live_together, (p, q, note)


def test_live_buffers_never_overlap_and_dead_ones_are_reused():
    rng = np.random.default_rng(0)
    for _ in range(50):
        lifetimes, sizes = _random_buffers(rng, 30, 5)
        offsets, total = plan_arena(lifetimes, sizes)
        _assert_live_ones_apart(lifetimes, offsets, sizes)
        assert total <= sum(-(-s // 64) * 64 for s in sizes.values())
    # a chain a -> b -> c: a and c never live together, so they share
    offsets, total = plan_arena({"a": (0, 1), "b": (1, 2), "c": (2, 3)}, {"a": 1024, "b": 1024, "c": 1024})
    assert offsets["a"] == offsets["c"] and total == 2048


def test_placing_each_buffer_on_its_neighbours_beneath_is_a_plan_at_any_smaller_sizes():
    """Sizes known at run time: the plan is made at the bounds, and each buffer goes at the
    greatest aligned end of the buffers directly beneath it there (what the entry computes).
    Whatever sizes up to the bounds a call has, no two live buffers share bytes, nothing
    ends past the arena planned at the bounds, and where sizes shrink the buffers pack down."""
    from modelkiln.artifacts.memory_plan import directly_beneath
    rng = np.random.default_rng(1)
    for _ in range(50):
        lifetimes, bounds = _random_buffers(rng, 40, 6)
        offsets, total = plan_arena(lifetimes, bounds)
        beneath = directly_beneath(offsets, lifetimes)
        for scale in (0.0, 0.1, 0.5, 1.0):
            sizes = {t: int(b * scale * rng.random()) if scale < 1 else b for t, b in bounds.items()}
            at = {}
            for t in sorted(offsets, key=lambda t: (offsets[t], t)):
                at[t] = max((-(-(at[x] + sizes[x]) // 64) * 64 for x in beneath[t]), default=0)
            _assert_live_ones_apart(lifetimes, at, sizes, scale)
            assert all(at[p] + sizes[p] <= total and at[p] <= offsets[p] for p in lifetimes)
            if scale == 0.0:
                assert all(v == 0 for v in at.values())
