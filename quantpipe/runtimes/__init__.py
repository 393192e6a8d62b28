"""Inference runtimes that run the same ONNX files: base (the interface and the parity check),
registry (the runtimes by name, the reference named once), one module per runtime."""
