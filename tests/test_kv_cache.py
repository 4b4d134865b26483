"""A decoder's KV cache kept in place (ir/passes/kv_cache.py): the past inputs and present
outputs share one buffer, `capacity` entries long, and a call appends only its own entries.
Checked against onnxruntime running the same model with the past fed as arrays."""
import json
import os
import subprocess

import numpy as np
import pytest

from modelkiln.artifacts.errors import KilnError
from modelkiln.artifacts.link import find_cc
from modelkiln.ir import PassContext
from modelkiln.orchestrator.api import build
from modelkiln.orchestrator.explain import explain
from tests import dynamic_zoo, model_zoo
from tests.conftest import shared_cache

DIMS = {"batch": (1, 2), "seq": (1, 16), "past": (0, 60)}
PROMPT = [5, 17, 3, 40, 11]


@pytest.fixture(scope="module")
def decoder(executor):
    """GPT-2 with position ids computed as Range(past, past + seq) from the shapes."""
    model, info = dynamic_zoo.gpt2_decoder_dynamic(positions="range")
    result = build(model, dims=DIMS, executor=executor, cache=None, progress=False)
    return model, info, result


def _onnxruntime(model):
    return lambda feeds: model_zoo.onnxruntime_outputs(model, feeds)


def test_the_caches_are_found_and_described(decoder):
    model, info, result = decoder
    manifest = json.loads(result.files["manifest.json"])
    presents = [f"present_{kind}_{i}" for i in range(info["layers"]) for kind in ("key", "value")]
    assert [(c["past"], c["present"], c["axis"], c["capacity"]) for c in manifest["caches"]] == \
        [(p.replace("present", "past"), p, 2, "capacity") for p in presents]
    assert {"name": "capacity", "least": 1, "greatest": 76} in manifest["symbols"]
    ops = [op for call in manifest["calls"] for op in call["ops"]]
    assert "Concat" not in ops and ops.count("kiln.AppendCache") == len(presents)
    assert ops.count("kiln.MatMulTransposedB") == info["layers"]  # (the scores read the keys as cached)
    assert "KV cache in place: past_key_0 -> present_key_0, appended along axis 2" in \
        explain(model, dims=DIMS)


def test_greedy_decoding_in_place_gives_onnxruntime_tokens(decoder):
    """The prompt from an empty cache, then 32 steps of one token, each appending to the
    cache: onnxruntime's tokens and logits, and at the end its presents are the cache's."""
    model, info, result = decoder
    module = result.load()
    cache = module.new_cache()
    assert cache.length == 0 and cache.capacity == 76
    want_tokens, want_logits = dynamic_zoo.greedy_tokens(_onnxruntime(model), info, PROMPT, 32)
    got_tokens, got_logits = dynamic_zoo.greedy_tokens(lambda f: module.run(f, cache=cache), info, PROMPT, 32,
                                                       feed_past=False)
    assert got_tokens == want_tokens
    for step, (got, want) in enumerate(zip(got_logits, want_logits)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")
    assert cache.length == len(PROMPT) + 32
    # The cache holds what onnxruntime's last presents hold (the last token's entries excepted:
    # they are appended by the call that would come next).
    feeds = {"input_ids": np.array([PROMPT + want_tokens[:-1]], np.int64),
             **{f"past_{kind}_{i}": np.zeros((1, info["heads"], 0, info["dh"]), np.float32)
                for i in range(info["layers"]) for kind in ("key", "value")}}
    whole = model_zoo.onnxruntime_outputs(model, feeds)
    for name in ("present_key_0", "present_value_1"):
        np.testing.assert_allclose(cache[name], whole[name], rtol=1e-4, atol=1e-4)


def test_a_step_writes_only_its_own_entries(decoder):
    """The entries after the new ones are never touched, and the past is read where it lies:
    filled with onnxruntime's presents, a step appends exactly onnxruntime's next entries."""
    model, info, result = decoder
    module = result.load()
    rng = np.random.default_rng(3)
    past = {f"past_{kind}_{i}": rng.standard_normal((2, info["heads"], 9, info["dh"])).astype(np.float32)
            for i in range(info["layers"]) for kind in ("key", "value")}
    ids = np.array([[7, 8], [9, 10]], np.int64)
    want = model_zoo.onnxruntime_outputs(model, {"input_ids": ids, **past})
    cache = module.new_cache(batch=2, capacity=40)
    for name, buf in cache.buffers.items():
        buf[...] = np.nan
        buf[:, :, :9] = past[name.replace("present", "past")]
    cache.length = 9
    got = module.run({"input_ids": ids}, cache=cache)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-4)
    for name, buf in cache.buffers.items():
        np.testing.assert_allclose(buf[:, :, :11], want[name], rtol=1e-5, atol=1e-5)
        assert np.isnan(buf[:, :, 11:]).all(), name  # (the room left is left alone)
        assert np.shares_memory(got[name], buf) and got[name].shape == want[name].shape


def test_an_optimum_merged_decoder_keeps_its_cache_in_place(executor):
    """The merged decoder (an If on use_cache_branch between the decoder with past and the
    prefill-only one): both branches append into the cache's buffer, and greedy decoding in
    place gives onnxruntime's tokens; a prefill with entries already held is refused by name."""
    model, info = dynamic_zoo.gpt2_merged_decoder()
    result = build(model, dims={"batch": (1, 1), "seq": (1, 16), "past": (0, 60)}, executor=executor, cache=None,
                   progress=False)
    manifest = json.loads(result.files["manifest.json"])
    assert len(manifest["caches"]) == 2 * info["layers"]
    assert sum(call["ops"].count("kiln.AppendCache") for call in manifest["calls"]) == 4 * info["layers"]
    module = result.load()
    cache = module.new_cache()
    want_tokens, want_logits = dynamic_zoo.greedy_tokens(_onnxruntime(model), info, PROMPT, 24)
    got_tokens, got_logits = dynamic_zoo.greedy_tokens(lambda f: module.run(f, cache=cache), info, PROMPT, 24,
                                                       feed_past=False)
    assert got_tokens == want_tokens
    np.testing.assert_allclose(got_logits[-1], want_logits[-1], rtol=1e-4, atol=1e-4)
    with pytest.raises(KilnError, match=r"output \d+ when 'use_cache_branch' is false: past \+ seq = \d+ and seq = 1 "
                                        r"must be equal"):
        module.run({"input_ids": np.array([[3]], np.int64), "position_ids": np.array([[cache.length]], np.int64),
                    "use_cache_branch": np.array([False])}, cache=cache)


def test_past_as_arrays_still_runs_and_matches(decoder):
    """Without a cache the past comes as arrays and the presents go to new arrays, as before:
    the entry copies the past into the present's buffer first."""
    model, info, result = decoder
    got_tokens, got_logits = dynamic_zoo.greedy_tokens(result.load().run, info, PROMPT, 12)
    want_tokens, want_logits = dynamic_zoo.greedy_tokens(_onnxruntime(model), info, PROMPT, 12)
    assert got_tokens == want_tokens
    np.testing.assert_allclose(got_logits[-1], want_logits[-1], rtol=1e-4, atol=1e-4)


def test_a_full_cache_and_misuse_are_named_and_run_nothing(decoder):
    model, info, result = decoder
    module = result.load()
    cache = module.new_cache(capacity=8)
    module.run({"input_ids": np.array([PROMPT], np.int64)}, cache=cache)
    before = {n: b.copy() for n, b in cache.buffers.items()}
    with pytest.raises(KilnError, match=r"the KV cache is full: 'present_key_0' would hold 9 entries along axis 2, "
                                        r"its buffer has room for 8"):
        module.run({"input_ids": np.array([[1, 2, 3, 4]], np.int64)}, cache=cache)
    assert cache.length == 5 and all(np.array_equal(before[n], b, equal_nan=True) for n, b in cache.buffers.items())
    with pytest.raises(KilnError, match="past_key_0, past_value_0, .* come from the cache"):
        module.run({"input_ids": np.array([[1]], np.int64),
                    "past_key_0": np.zeros((1, info["heads"], 5, info["dh"]), np.float32),
                    "past_value_0": np.zeros((1, info["heads"], 5, info["dh"]), np.float32),
                    "past_key_1": np.zeros((1, info["heads"], 5, info["dh"]), np.float32)}, cache=cache)
    with pytest.raises(KilnError, match=r"input 'past_key_0': dim 0 is batch = 1, but input 'input_ids' has "
                                        r"batch = 2"):
        module.run({"input_ids": np.array([[1], [2]], np.int64)}, cache=cache)
    with pytest.raises(KilnError, match=r"new_cache: capacity = 100 is outside the bounds .* \(capacity = 1\.\.76\)"):
        module.new_cache(capacity=100)
    with pytest.raises(KilnError, match="new_cache: no symbol heads"):
        module.new_cache(heads=3)
    other = build(model_zoo.cnn(), cache=shared_cache(), progress=False).load()
    with pytest.raises(KilnError, match="keeps no KV cache in place"):
        other.new_cache()
    with pytest.raises(KilnError, match="expected a KVCache from this module"):
        module.run({"input_ids": np.array([[1]], np.int64)}, cache="not a cache")


def test_the_pass_leaves_a_present_read_some_other_way_as_written(executor):
    """A present read by something that needs it dense (here a ReduceSum, as another output)
    keeps its Concat and its copies, and the model still runs as onnxruntime does."""
    from onnx import TensorProto, helper
    model, info = dynamic_zoo.gpt2_decoder_dynamic(layers=1)
    graph = model.graph
    graph.node.append(helper.make_node("ReduceSum", ["present_key_0"], ["key_total"], keepdims=0))
    graph.output.append(helper.make_tensor_value_info("key_total", TensorProto.FLOAT, []))
    result = build(model, dims=DIMS, executor=executor, cache=None, progress=False)
    manifest = json.loads(result.files["manifest.json"])
    assert [c["past"] for c in manifest["caches"]] == ["past_value_0"]
    got, _ = dynamic_zoo.greedy_tokens(result.load().run, info, PROMPT, 6)
    want, _ = dynamic_zoo.greedy_tokens(_onnxruntime(model), info, PROMPT, 6)
    assert got == want


def test_the_pass_can_be_turned_off(executor):
    model, info = dynamic_zoo.gpt2_decoder_dynamic(layers=1)
    result = build(model, dims=DIMS, executor=executor, cache=None, progress=False,
                   pass_context=PassContext(disabled_pass={"bind_kv_caches"}))
    manifest = json.loads(result.files["manifest.json"])
    assert "caches" not in manifest and "Concat" in [op for c in manifest["calls"] for op in c["ops"]]
    got, _ = dynamic_zoo.greedy_tokens(result.load().run, info, PROMPT, 4)
    assert got == dynamic_zoo.greedy_tokens(_onnxruntime(model), info, PROMPT, 4)[0]


GENERATE_C = r"""
/* Greedy decoding from C with the cache in place: one buffer per cache, passed as both the
 * past input and the present output, grown by one entry per call. Prints the tokens. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kiln_model.h"

int main(int argc, char** argv) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", argv[1], KILN_WEIGHTS_FILE);
  char* weights = kiln_load_weights(path);
  char* arena = kiln_alloc_arena();
  int steps = atoi(argv[2]), prompt = argc - 3;
  long long dims[KILN_NUM_SYMBOLS];
  long long ids[64];
  void* inputs[KILN_NUM_INPUTS] = {0};
  void* outputs[KILN_NUM_OUTPUTS] = {0};
  int at = -1;
  for (int k = 0; k < KILN_NUM_SYMBOLS; ++k) {
    dims[k] = kiln_symbol_greatest[k];  /* (the capacity: the most entries) */
    if (!strcmp(kiln_symbol_names[k], "batch")) dims[k] = 1;
  }
  for (int c = 0; c < KILN_NUM_CACHES; ++c) {
    void* buffer = calloc(1, kiln_output_bytes_at(kiln_cache_outputs[c], dims));
    inputs[kiln_cache_inputs[c]] = outputs[kiln_cache_outputs[c]] = buffer;
  }
  for (int i = 0; i < KILN_NUM_INPUTS; ++i) if (!strcmp(kiln_input_names[i], "input_ids")) inputs[i] = ids;
  for (int i = 0; i < KILN_NUM_OUTPUTS; ++i) if (!strcmp(kiln_output_names[i], "logits")) at = i;
  outputs[at] = malloc(kiln_output_bytes_at(at, dims));
  for (int i = 0; i < prompt; ++i) ids[i] = atoll(argv[3 + i]);
  long long past = 0, seq = prompt;
  for (int step = 0; step <= steps; ++step) {
    for (int k = 0; k < KILN_NUM_SYMBOLS; ++k) {
      if (!strcmp(kiln_symbol_names[k], "past")) dims[k] = past;
      if (!strcmp(kiln_symbol_names[k], "seq")) dims[k] = seq;
    }
    int rc = kiln_run_dims(weights, arena, inputs, outputs, dims, 0);
    if (rc) { fprintf(stderr, "kiln_run_dims returned %d\n", rc); return 1; }
    long long vocab = kiln_output_shapes[at][2];
    const float* last = (const float*)outputs[at] + (seq - 1) * vocab;
    long long best = 0;
    for (long long v = 1; v < vocab; ++v) if (last[v] > last[best]) best = v;
    printf("%lld ", best);
    past += seq; seq = 1; ids[0] = best;
  }
  printf("\n");
  return 0;
}
"""


def test_a_c_caller_decodes_with_one_buffer_per_cache(decoder, tmp_path):
    """kiln_model.h names the caches; a C program passing one buffer as both past and present
    generates onnxruntime's tokens."""
    model, info, result = decoder
    bundle = str(tmp_path / "bundle")
    result.export(bundle)
    header = open(os.path.join(bundle, "kiln_model.h")).read()
    assert "#define KILN_NUM_CACHES 4" in header
    source = tmp_path / "generate.c"
    source.write_text(GENERATE_C)
    program = str(tmp_path / "generate")
    proc = subprocess.run([find_cc(), "-O2", "-std=c11", "-Wall", "-Werror", str(source), "-I", bundle,
                           os.path.join(bundle, "model.so"), f"-Wl,-rpath,{bundle}", "-o", program],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([program, bundle, "20", *map(str, PROMPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    want, _ = dynamic_zoo.greedy_tokens(_onnxruntime(model), info, PROMPT, 20)
    assert [int(t) for t in proc.stdout.split()] == want
