"""The arena planner never lets two live buffers share bytes, and does reuse dead ones."""
import numpy as np

from modelkiln.artifacts.memory_plan import plan_arena


def test_live_buffers_never_overlap_and_dead_ones_are_reused():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 30))
        lifetimes, sizes = {}, {}
        for i in range(n):
            a = int(rng.integers(0, 20))
            lifetimes[f"t{i}"] = (a, a + int(rng.integers(0, 5)))
            sizes[f"t{i}"] = int(rng.integers(1, 5000))
        offsets, total = plan_arena(lifetimes, sizes)
        names = list(lifetimes)
        for i, p in enumerate(names):
            assert offsets[p] % 64 == 0
            for q in names[i + 1:]:
                live_together = lifetimes[p][0] <= lifetimes[q][1] and lifetimes[q][0] <= lifetimes[p][1]
                apart = offsets[p] + sizes[p] <= offsets[q] or offsets[q] + sizes[q] <= offsets[p]
                assert apart or not live_together, (p, q)
        assert total <= sum(-(-s // 64) * 64 for s in sizes.values())
    # a chain a -> b -> c: a and c never live together, so they share
    offsets, total = plan_arena({"a": (0, 1), "b": (1, 2), "c": (2, 3)}, {"a": 1024, "b": 1024, "c": 1024})
    assert offsets["a"] == offsets["c"] and total == 2048
