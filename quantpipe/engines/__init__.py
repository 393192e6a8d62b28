"""Quantization engines: base (the static engine interface and its result), registry (the static
engines by name: onnxruntime, nncf), graph (ONNX facts they share), one module per engine
(ort_static, nncf_ptq; dynamic and qat for their own stages)."""
