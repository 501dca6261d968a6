"""ONNX Runtime bindings: the ``DFlashBlockAttention`` custom op (CPU) and the ``onnxruntime`` backend."""
