"""A detector's post-processing, whose output length the data decide: NonMaxSuppression over
every class, then the kept boxes gathered, as YOLOv8 (8400 boxes, 80 classes, centre
format) and SSD-MobileNet (1917 boxes, 91 classes, corners) exports end. Kiln against
onnxruntime and OpenVINO on the same model and inputs.

    python bench/bench_detection.py [--threads 1] [--rounds 3]

Scores are a detector's: most far below the threshold, a few objects per class, each
found by a few dozen boxes that overlap it. Kiln's rows are checked against onnxruntime's first. Times: ms, the
better median of interleaved rounds. Prints a Markdown table.
"""
from __future__ import annotations

import os
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_models import beside_onnxruntime, interleaved, peer_table_args  # noqa: E402

# name: (boxes, classes, center_point_box, per-class limit, IoU threshold, score threshold)
CASES = {"YOLOv8 (640)": (8400, 80, 1, 100, 0.45, 0.25), "SSD-MobileNet (300)": (1917, 91, 0, 100, 0.6, 0.3)}


def postprocess(boxes: int, classes: int, center: int, most: int, iou: float, floor: float):
    consts = [numpy_helper.from_array(np.array([most], np.int64), "most"),
              numpy_helper.from_array(np.array([iou], np.float32), "iou"),
              numpy_helper.from_array(np.array([floor], np.float32), "floor"),
              numpy_helper.from_array(np.array(2, np.int64), "two")]
    nodes = [helper.make_node("NonMaxSuppression", ["boxes", "scores", "most", "iou", "floor"], ["selected"],
                              center_point_box=center),
             helper.make_node("Gather", ["selected", "two"], ["which"], axis=1),
             helper.make_node("Gather", ["boxes", "which"], ["kept"], axis=1)]
    graph = helper.make_graph(nodes, "postprocess",
                              [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, boxes, 4]),
                               helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, classes, boxes])],
                              [helper.make_tensor_value_info("selected", TensorProto.INT64, None),
                               helper.make_tensor_value_info("kept", TensorProto.FLOAT, None)], consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def detections(boxes: int, classes: int, center: int, seed: int = 0) -> dict:
    """A detector's raw output: every box scoring low for every class, except around a few
    objects per class, where a few dozen boxes jittered about the object's score high."""
    rng = np.random.default_rng(seed)
    xy, wh = rng.random((boxes, 2)) * 600, 20 + rng.random((boxes, 2)) * 80
    scores = 1 / (1 + np.exp(-(rng.standard_normal((classes, boxes)) * 1.5 - 6)))
    for c in range(classes):
        for _ in range(rng.integers(0, 4)):
            near = rng.choice(boxes, 40, replace=False)
            obj_xy, obj_wh = rng.random(2) * 600, 20 + rng.random(2) * 80
            xy[near] = obj_xy + rng.standard_normal((40, 2)) * 4
            wh[near] = obj_wh * (1 + rng.standard_normal((40, 2)) * 0.05)
            scores[c, near] = 0.3 + 0.7 * rng.random(40)
    box = np.concatenate([xy + wh / 2, wh], -1) if center else np.concatenate([xy[:, ::-1], (xy + wh)[:, ::-1]], -1)
    return {"boxes": box[None].astype(np.float32), "scores": scores[None].astype(np.float32)}


def main() -> None:
    args = peer_table_args(__doc__)
    print("| post-processing | rows kept | Kiln ms | onnxruntime ms | OpenVINO ms |")
    print("|---|---:|---:|---:|---:|")
    for name, (boxes, classes, center, most, iou, floor) in CASES.items():
        model = postprocess(boxes, classes, center, most, iou, floor)
        feeds = detections(boxes, classes, center)
        got, want, runs, request = beside_onnxruntime(model, feeds, args.threads)
        if not (np.array_equal(got["selected"], want[0]) and np.array_equal(got["kept"], want[1])):
            raise SystemExit(f"{name}: Kiln's rows differ from onnxruntime's")
        if request is not None and not np.array_equal(request.infer(feeds)[0], want[0]):
            print(f"{name}: OpenVINO's rows differ from onnxruntime's; left out", file=sys.stderr)
        elif request is not None:
            runs["openvino"] = lambda: request.infer(feeds)
        ms = interleaved(runs, warmup=3, repeat=20, rounds=args.rounds)
        ov_ms = f"{ms['openvino']:.3f}" if "openvino" in ms else "-"
        print(f"| {name}: {boxes} boxes, {classes} classes | {len(want[0])} | {ms['kiln']:.3f} | "
              f"{ms['onnxruntime']:.3f} | {ov_ms} |")


if __name__ == "__main__":
    main()
