"""Serving: the Triton model repository exporter, the bundled-tritonserver launcher and metric sinks.

Pipeline place: after ``dflash-trt build`` (or straight from checkpoints), before clients. Nothing here
imports tritonclient, pytriton or ``triton_python_backend_utils`` at module import (docs/style.md R10); those are
the ``triton`` extra and are imported inside the functions that need them. Reference: docs/serving-notes.md §6.
"""
