"""What a DFlash2 drafter cannot be built into is refused before anything is written, with the reason and the fix:
a TensorRT-LLM bundle (TensorRT-LLM has no DFlash2 decoding mode) and the plugin-node drafter graph. ``inspect``
says which backends take the drafter. (Engines that run one: tests/plugins/onnxruntime/test_dflash2_engine.py,
tests/plugins/tensorrt/test_dflash2_tensorrt.py.)"""

from __future__ import annotations

import pytest
from tiny_models import DraftSpec, TargetSpec

from dflash_trt.builder.engine import BuildConfig, build_engine
from dflash_trt.builder.inspect import describe_checkpoint
from dflash_trt.errors import ConfigError

TARGET = TargetSpec()
DFLASH2 = DraftSpec(seed=44, architecture="dflash2")


def test_a_trtllm_bundle_of_a_dflash2_drafter_is_refused_with_the_alternatives(zoo, tmp_path):
    out = tmp_path / "bundle"
    with pytest.raises(ConfigError) as refused:
        build_engine(BuildConfig(target=zoo.target(TARGET), draft=zoo.drafter(TARGET, DFLASH2), out=out,
                                 backend="trtllm"))
    message = str(refused.value)
    for words in ("DFlash2DraftModel", "--backend trtllm", "no DFlash2 decoding mode", "Fix:",
                  "--backend onnxruntime", "--backend tensorrt", "vLLM or SGLang"):
        assert words in message, words
    assert not out.exists() and list(tmp_path.iterdir()) == []  # refused before anything was staged


def test_the_plugin_drafter_graph_of_a_dflash2_drafter_is_refused(zoo, tmp_path):
    with pytest.raises(ConfigError, match=r"field `drafter_graph` is 'plugin' with a DFlash2 drafter.*Fix: omit "
                                          r"--drafter-graph"):
        build_engine(BuildConfig(target=zoo.target(TARGET), draft=zoo.drafter(TARGET, DFLASH2), out=tmp_path / "e",
                                 backend="onnxruntime", drafter_graph="plugin"))


def test_inspect_says_which_backends_take_a_drafter(zoo):
    dflash2 = describe_checkpoint(zoo.drafter(TARGET, DFLASH2))["backends"]
    assert dflash2.startswith("torch, onnxruntime, tensorrt; not trtllm (TensorRT-LLM serves DFlash drafters")
    assert describe_checkpoint(zoo.drafter(TARGET, DraftSpec(seed=44)))["backends"].endswith("trtllm")
