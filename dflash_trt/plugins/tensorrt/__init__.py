"""TensorRT bindings (GPU only): the ``DFlashBlockAttention`` IPluginV3 (``csrc/``), its build script, and the
``tensorrt`` backend. Nothing here imports ``tensorrt`` at module import; every runtime path checks for a
GPU first (docs/environment.md §6.3: a TensorRT runtime created without a GPU segfaults on deserialisation)."""
