"""plugins/schema.py: one declaration per op, a stable ABI stamp, and a binding in every backend (style R9)."""

from __future__ import annotations

import importlib
from pathlib import Path

from dflash_trt.plugins.schema import BINDINGS, BLOCK_ATTENTION, SCHEMAS


def test_every_op_has_a_binding_in_every_backend():
    for name in SCHEMAS:
        assert set(BINDINGS[name]) == {"torch", "onnxruntime", "tensorrt"}


def test_python_bindings_resolve_to_objects():
    for name in SCHEMAS:
        for backend in ("torch", "onnxruntime"):
            module, attr = BINDINGS[name][backend].split(":")
            if backend == "onnxruntime":
                attr = "block_attention_numpy"  # the op itself is registered lazily by register()
            assert callable(getattr(importlib.import_module(module), attr))


def test_tensorrt_binding_source_names_the_schema_plugin():
    source = Path(__file__).parents[2] / BINDINGS[BLOCK_ATTENTION.qualified_name]["tensorrt"].split(":")[0]
    header = source.with_name("block_attention.h").read_text()
    assert f'kPluginName = "{BLOCK_ATTENTION.onnx_op_type}"' in header
    assert f'kPluginVersion = "{BLOCK_ATTENTION.version}"' in header
    assert f'kPluginNamespace = "{BLOCK_ATTENTION.namespace}"' in header


def test_abi_is_a_stable_hash_of_the_declaration():
    stamp = BLOCK_ATTENTION.stamp()
    assert stamp["name"] == "dflash::block_attention" and len(stamp["abi"]) == 16
    assert BLOCK_ATTENTION.abi == BLOCK_ATTENTION.abi
    changed = BLOCK_ATTENTION.__class__(**{**BLOCK_ATTENTION.__dict__, "version": "2"})
    assert changed.abi != BLOCK_ATTENTION.abi
