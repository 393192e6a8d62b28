"""Inference engines that run the same ONNX files: base (the interface and the parity check),
registry (the engines by name, the reference named once), one module per engine."""
