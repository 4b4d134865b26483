"""Whole models, built and run, against onnxruntime as the oracle."""
import pytest

from tests import model_zoo
from tests.conftest import build_and_compare, shared_cache


@pytest.mark.parametrize("name", sorted(model_zoo.ALL))
def test_model_matches_onnxruntime(name, executor):
    result, _ = build_and_compare(model_zoo.ALL[name](), executor)
    assert result.report["totals"]["failed"] == 0
    assert result.report["totals"]["compiled"] == result.report["totals"]["kernels"]


def test_resnet18_fuses_conv_epilogues(executor):
    """BatchNorm folds into the convs, and relu / residual adds run as conv epilogues."""
    result, _ = build_and_compare(model_zoo.resnet18(), executor)
    ops = [tuple(k["ops"]) for k in result.report["kernels"]]
    assert not any("BatchNormalization" in o for o in ops)
    assert ("Conv", "Relu") in ops
    assert ("Conv", "Add", "Relu") in ops
    assert sum(o[0] == "Conv" for o in ops) == 20  # every conv of ResNet-18, none split or dropped


def test_pytorch_shape_chain_folds_away(executor):
    result, _ = build_and_compare(model_zoo.pytorch_reshape_chain(), executor)
    remaining = {n.op for n in result.graph.nodes}
    assert not remaining & {"Shape", "Gather", "Unsqueeze", "Concat"}


def test_batch_size_from_shape_override(executor):
    """A model declared at batch 1 built for batch 4 with shapes=..."""
    import numpy as np
    from modelkiln.orchestrator.api import build
    model = model_zoo.cnn()
    module = build(model, shapes={"x": [4, 3, 32, 32]}, executor=executor, cache=shared_cache()).load()
    x = np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)
    got = module.run({"x": x})["logits"]
    for i in range(4):  # each row must equal the batch-1 model on that image (oracle: onnxruntime)
        want = model_zoo.onnxruntime_outputs(model, {"x": x[i:i + 1]})["logits"]
        np.testing.assert_allclose(got[i:i + 1], want, rtol=1e-3, atol=1e-4)


def test_module_is_safe_across_threads(executor):
    """One module, four threads, different inputs: every result equals onnxruntime's."""
    import threading

    import numpy as np
    from modelkiln.orchestrator.api import build
    model = model_zoo.mobilenet_v2(size=64)
    module = build(model, executor=executor, cache=shared_cache()).load()
    inputs = [model_zoo.random_inputs(model, seed) for seed in range(4)]
    want = [model_zoo.onnxruntime_outputs(model, x)["logits"] for x in inputs]
    errors = []

    def worker(i):
        for _ in range(10):
            got = module.run(inputs[i])["logits"]
            if not np.allclose(got, want[i], rtol=1e-3, atol=1e-4):
                errors.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_run_into_preallocated_outputs_and_from_read_only_inputs(cnn_bundle):
    """`out=` writes into the caller's arrays (and returns them), a loop allocating nothing;
    inputs that are read-only views work; an output array of the wrong type is refused by name."""
    import numpy as np
    import pytest
    from modelkiln import load
    from modelkiln.artifacts.errors import KilnError
    module = load(cnn_bundle)
    model = model_zoo.cnn()
    x = model_zoo.random_inputs(model, 5)["x"]
    frozen = np.frombuffer(x.tobytes(), np.float32).reshape(x.shape)  # read-only
    want = model_zoo.onnxruntime_outputs(model, {"x": x})["logits"]
    out = {"logits": np.full((1, 10), np.nan, np.float32)}
    got = module.run({"x": frozen}, out=out)
    assert got is out and not np.isnan(out["logits"]).any()
    np.testing.assert_allclose(out["logits"], want, rtol=1e-3, atol=1e-4)
    with pytest.raises(KilnError, match="out\\['logits'\\].*float32.*float64"):
        module.run({"x": x}, out={"logits": np.zeros((1, 10), np.float64)})
