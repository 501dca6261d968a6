"""TensorRT-LLM: running a ``--backend trtllm`` bundle (``builder/bundle_trtllm.py``) through ``tensorrt_llm.LLM`` on
GPUs. Nothing here imports ``tensorrt_llm`` at module import; the runner checks for a GPU first."""
