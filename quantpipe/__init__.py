"""quantpipe: PyTorch -> ONNX -> INT8, each step a DVC stage. Stage scripts live in stages/."""
