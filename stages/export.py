"""export: models/model.pt -> models/exported.onnx (dynamic batch), parity-checked vs PyTorch."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from quantpipe import data, models, onnxutil  # noqa: E402
from quantpipe.errors import UserError  # noqa: E402
from quantpipe.io import run_stage, write_bytes, write_json  # noqa: E402
from quantpipe.params import load_params  # noqa: E402

PREPARED = Path("data/prepared")
MODEL = Path("models/model.pt")
EXPORTED = Path("models/exported.onnx")
# Parity is checked on this many real test images (and the batch axis on two batch sizes).
PARITY_SAMPLES = 256


def main() -> None:
    params = load_params()
    info = data.load_info(PREPARED)
    test = data.load_split(PREPARED, "test")
    x = data.normalize(test.x[:PARITY_SAMPLES], info)
    source = models.onnx_source(params.train.model)
    if source:  # bring your own ONNX: validate it against the data instead of exporting
        proto, facts = onnxutil.import_onnx(source, info.input_shape, info.num_classes, x,
                                            params.runtime.graph_optimization_level)
        write_bytes(EXPORTED, proto.SerializeToString())
        write_json("metrics/export.json", facts)
        print(f"export: {source} checked against the data ({info.input_shape}, "
              f"{info.num_classes} classes) -> {EXPORTED}")
        return
    model = models.build_model(params.train.model, info.channels, info.image_size, info.num_classes)
    models.load_weights(model, MODEL)
    proto = onnxutil.export_onnx(model, info.input_shape, params.export.opset)
    blob = onnxutil.check_and_serialize(proto, str(EXPORTED))

    with torch.no_grad():
        expected = models.predict_torch(model, x)
    session = onnxutil.make_session(blob, level=params.runtime.graph_optimization_level)
    # Batch 1 and a larger batch: the dynamic batch axis must work for both.
    got_one = onnxutil.run_batched(session, x[:8], batch_size=1)
    got = onnxutil.run_batched(session, x, batch_size=len(x))
    diff = max(onnxutil.max_abs_diff(got, expected), onnxutil.max_abs_diff(got_one, expected[:8]))
    limit = onnxutil.parity_limit(expected, params.export.max_abs_diff)
    if diff > limit:
        raise UserError(f"{EXPORTED}: ONNX logits differ from PyTorch by {diff:.3g} > {limit:.3g} "
                        f"(export.max_abs_diff = {params.export.max_abs_diff:g} x the largest "
                        f"logit, {abs(expected).max():.3g}); the export is wrong (try another "
                        "export.opset) or the tolerance too tight")
    write_bytes(EXPORTED, blob)
    write_json("metrics/export.json", {
        "opset": params.export.opset, "max_abs_diff": diff, "limit": limit, "parity_samples": len(x),
        "size_bytes": len(blob), "nodes": len(proto.graph.node)})
    print(f"export: max |onnx - torch| = {diff:.2e} on {len(x)} test images -> {EXPORTED}")


if __name__ == "__main__":
    run_stage(main)
