"""The ONNX node form of each ``plugins/schema.py`` op, shared by the exporter, ONNX Runtime and TensorRT.

A plugin node is ``DFlashBlockAttention`` in domain ``dflash`` with the schema's attributes plus
``plugin_version``/``plugin_namespace``, which the TensorRT ONNX parser uses to find the plugin
creator (docs/serving-notes.md §4.4). ONNX Runtime runs Python custom ops only in domain ``ai.onnx.contrib``
(docs/environment.md §4.3), so :func:`to_ort_domain` renames the nodes when a session is created; the file
on disk keeps ``dflash``. Needs ``onnx`` and ``onnxscript`` (the ``onnx`` extra); imported lazily.
"""

from __future__ import annotations

from dflash_trt.plugins.schema import BLOCK_ATTENTION, OpSchema

ONNX_DOMAIN = BLOCK_ATTENTION.namespace
ORT_CONTRIB_DOMAIN = "ai.onnx.contrib"
_OPSET_VERSION = 1
_registered: set[str] = set()


def register_onnx_schema(schema: OpSchema = BLOCK_ATTENTION) -> None:
    """Declare the op to ``onnx.defs`` (once per process) so ``onnx.checker`` and the exporter know its
    inputs, outputs and attributes."""
    if schema.qualified_name in _registered:
        return
    from onnx import defs

    param = defs.OpSchema.FormalParameter
    attr_types = {"float": defs.OpSchema.AttrType.FLOAT, "int": defs.OpSchema.AttrType.INT,
                  "string": defs.OpSchema.AttrType.STRING}
    attributes = [defs.OpSchema.Attribute(a.name, attr_types[a.kind], a.doc) for a in schema.attributes]
    attributes += [defs.OpSchema.Attribute("plugin_version", attr_types["string"], "TensorRT plugin version"),
                   defs.OpSchema.Attribute("plugin_namespace", attr_types["string"], "TensorRT plugin namespace")]
    onnx_schema = defs.OpSchema(
        schema.onnx_op_type, ONNX_DOMAIN, _OPSET_VERSION, doc=schema.doc,
        inputs=[param(t.name, "T", t.doc) for t in schema.inputs],
        outputs=[param(t.name, "T", t.doc) for t in schema.outputs],
        type_constraints=[("T", ["tensor(float)"], "float32 activations")],
        attributes=attributes,
    )
    if not defs.has(schema.onnx_op_type, ONNX_DOMAIN):
        defs.register_schema(onnx_schema)
    _registered.add(schema.qualified_name)


def block_attention_translation():
    """The torch -> ONNX translation of ``torch.ops.dflash.block_attention`` (for ``custom_translation_table``)."""
    import onnxscript

    register_onnx_schema(BLOCK_ATTENTION)
    opset = onnxscript.values.Opset(ONNX_DOMAIN, _OPSET_VERSION)

    def translate(q, context_k, context_v, block_k, block_v, scale: float, window: int, causal: int):
        return opset.DFlashBlockAttention(q, context_k, context_v, block_k, block_v, scale=scale, window=window,
                                          causal=causal, plugin_version=BLOCK_ATTENTION.version,
                                          plugin_namespace=BLOCK_ATTENTION.namespace)

    return translate


def plugin_nodes(model) -> list:
    """The nodes of ``model`` (an ``onnx.ModelProto``) that are plugin ops of ours."""
    return [node for node in model.graph.node if node.domain in (ONNX_DOMAIN, ORT_CONTRIB_DOMAIN)]


def to_ort_domain(model):
    """Copy of ``model`` with every ``dflash`` node and opset import moved to ``ai.onnx.contrib``."""
    import onnx

    model = onnx.ModelProto.FromString(model.SerializeToString())
    for node in model.graph.node:
        if node.domain == ONNX_DOMAIN:
            node.domain = ORT_CONTRIB_DOMAIN
    has_contrib = any(entry.domain == ORT_CONTRIB_DOMAIN for entry in model.opset_import)
    kept = []
    for entry in model.opset_import:
        if entry.domain == ONNX_DOMAIN:
            if has_contrib:
                continue
            entry.domain = ORT_CONTRIB_DOMAIN
        kept.append(entry)
    del model.opset_import[:]
    model.opset_import.extend(kept)
    return model
