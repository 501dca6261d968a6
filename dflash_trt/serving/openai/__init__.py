"""An OpenAI-compatible HTTP server over the batched ``Session`` (``dflash-trt serve``; docs/serving-openai.md).

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus_client, Jinja2); importing this package does not.
"""
