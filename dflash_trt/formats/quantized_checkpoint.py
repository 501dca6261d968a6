"""A target quantised to FP8 or NVFP4 in the ModelOpt HF export format: make it, write it, read it, run it.

The folder is what ``modelopt.torch.export.export_hf_checkpoint`` (0.47.0) writes and what
TensorRT-LLM's PyTorch backend, vLLM and SGLang read (docs/serving-notes.md §3.1):

- ``config.json``: an HF Llama/Qwen3 config plus ``quantization_config`` (``quant_method: modelopt``);
- ``hf_quant_config.json``: ``{"producer", "quantization": {quant_algo, kv_cache_quant_algo,
  group_size (NVFP4), exclude_modules}}``;
- ``model.safetensors``: HF tensor names (``model.layers.{i}.self_attn.q_proj.weight`` ...), each
  quantised linear with ``weight``, ``weight_scale``, ``input_scale`` and, for NVFP4, ``weight_scale_2``.

What is quantised follows ModelOpt's defaults: the decoder linears (q/k/v/o/gate/up/down); the
embedding, the norms and ``lm_head`` stay in the model dtype and are listed in ``exclude_modules``.
NVFP4 also excludes a linear whose input dim is not a multiple of 16 (ModelOpt's export refuses
it; stories260K's ``down_proj`` has 172 inputs). As ModelOpt does for NVFP4, siblings that read the
same input (q/k/v, gate/up) share ``weight_scale_2`` and ``input_scale`` (max of their amaxes),
so a fused QKV/gate-up GEMM can use one global scale; FP8 scales stay per linear.

Static activation scales come from calibration, as ModelOpt's max calibrator does: the
unquantised target runs over a batch of token ids and each linear records ``max |input|``.

At run time on CPU a quantised linear is a float32 GEMM on the dequantised weight (weight-only,
the default, :class:`QuantizedLinear`). With ``activations="quantized"`` its input is quantised with
``input_scale`` and the product is taken on the exact integer values of both quantised operands
(:class:`IntegerQuantizedLinear`), emulating the W8A8 / W4A4 GEMM a server runs. On a GPU the same
tensors feed an FP8 GEMM (``torch._scaled_mm``, see :class:`Fp8Linear`) or TensorRT-LLM's FP4 GEMM.

Speculative decoding stays lossless relative to *this quantised target*: it reproduces the
quantised target's greedy output, not the float model's. That needs every row of a k+1-token
verify forward to be the same bits as a 1-token plain step. A static FP8/FP4 activation quantiser
turns a last-bit difference at its input into a whole grid step, so the quantised GEMMs here are
exact integer sums, which do not depend on the number of rows (batch-invariant), and the float ops
around them (norms, SiLU, attention, the unquantised linears) take the fixed-order forms of
``model/batch_invariant.py``. docs/quantization.md §4.1 states what that guarantees.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from dflash_trt import __version__
from dflash_trt.model import quantize as q
from dflash_trt.model.batch_invariant import make_batch_invariant
from dflash_trt.formats.hf_config import parse_target_config, target_config_json
from dflash_trt.formats.safe_files import read_json, read_tensors, safetensors_files
from dflash_trt.formats.target_checkpoint import check_state_dict
from dflash_trt.formats.tensor_stream import SafetensorsWriter, TensorSource
from dflash_trt.config import TargetConfig
from dflash_trt.errors import CheckpointFormatError
from dflash_trt.model.target import TargetModel
from dflash_trt.tokenizer import HFTokenizer, Llama2cTokenizer, Tokenizer

LINEAR_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
"""Per decoder layer, the linears that are quantised (ModelOpt's default ``*`` minus the excluded heads)."""
SHARED_INPUT_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
"""Siblings that read one input; NVFP4 unifies their global and input scales (ModelOpt ``preprocess_linear_fusion``)."""
ALWAYS_EXCLUDED = ("lm_head", "model.embed_tokens")
QUANT_ALGOS: dict[str, str] = {"fp8": "FP8", "nvfp4": "NVFP4"}
Activations = Literal["quantized", "float"]


def calibration_batch(tokenizer: Tokenizer, texts: Sequence[str], length: int) -> Tensor:
    """Token ids of every text with at least ``length`` tokens, cut to ``length``. Shape ``[N, T]`` int64."""
    rows = [ids[:length] for ids in (tokenizer.encode(text) for text in texts) if len(ids) >= length]
    if not rows:
        raise ValueError(f"no calibration text has {length} tokens; pass longer texts or a smaller length")
    return torch.tensor(rows, dtype=torch.long)


@torch.inference_mode()
def calibrate_input_amax(model: TargetModel, calibration: Tensor) -> dict[str, Tensor]:
    """``max |x|`` of the input of every decoder linear over the calibration tokens, keyed ``layers.{i}.{name}``.

    The float model runs unquantised (ModelOpt calibrates with quantisation off). Shapes:
    calibration ``[N, T]`` token ids -> fp32 scalars.
    """
    amaxes: dict[str, Tensor] = {}
    hooks = []
    for index, layer in enumerate(model.layers):
        for name in LINEAR_NAMES:
            key = f"layers.{index}.{name}"

            def record(_module: nn.Module, args: tuple[Tensor, ...], key: str = key) -> None:
                seen = q.amax(args[0])
                amaxes[key] = torch.maximum(amaxes[key], seen) if key in amaxes else seen

            hooks.append(layer.get_submodule(name).register_forward_pre_hook(record))
    try:
        cache = model.new_cache(1, calibration.shape[1])
        for row in calibration:  # one sequence at a time keeps memory at one row of activations
            cache.reset()
            model(row.view(1, -1), 0, cache)
    finally:
        for hook in hooks:
            hook.remove()
    return amaxes


def quantize_target(model: TargetModel, mode: q.QuantMode, calibration: Tensor) -> tuple[dict[str, Tensor], dict]:
    """Quantise the decoder linears of ``model`` and return (export state dict, ``hf_quant_config``).

    The state dict holds every tensor of the HF checkpoint under its HF name: quantised linears as
    ``weight``/``weight_scale``/[``weight_scale_2``]/``input_scale`` (formulas in ``quantize.py``), all
    others unchanged. Shapes: calibration ``[N, T]`` token ids (see :func:`calibrate_input_amax`).
    The same code as :func:`quantize_checkpoint` (layer by layer), collected in memory.
    """
    state = {name: t.detach() for name, t in model.state_dict().items()
             if not (name == "lm_head.weight" and model.config.tie_word_embeddings)}
    plan, quant_config = quantization_plan(TensorSource.from_state(state), model.config, mode)
    return dict(quantized_tensors(TensorSource.from_state(state), model.config, mode, calibration, plan)), quant_config


def _source_key(source: TensorSource, name: str) -> str:
    """Our tensor name -> the source's key (HF folders prefix ``model.`` except ``lm_head``)."""
    return name if name in source.specs else _hf_name(name)


def quantization_plan(source: TensorSource, config: TargetConfig, mode: q.QuantMode
                      ) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], dict]:
    """Every tensor of the export, in the order :func:`quantized_tensors` yields them (HF name, dtype, shape), and
    ``hf_quant_config``. From the source's dtypes and shapes only: no tensor is read."""
    if mode not in QUANT_ALGOS:
        raise ValueError(f"quantization mode is {mode!r}; expected one of {sorted(QUANT_ALGOS)}")
    names = [k.removeprefix("model.") for k in source.specs if not k.endswith("rotary_emb.inv_freq")]
    if config.tie_word_embeddings:
        names = [n for n in names if n != "lm_head.weight"]
    plan: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    excluded: list[str] = []
    quantized = {f"layers.{i}.{linear}.weight" for i in range(config.num_layers) for linear in LINEAR_NAMES}
    for layer_name in _layer_order(names, config.num_layers):
        dtype, shape = source.specs[_source_key(source, layer_name)]
        if layer_name not in quantized:
            plan.append((_hf_name(layer_name), dtype, tuple(shape)))
            continue
        prefix, (out_features, in_features) = _hf_name(layer_name.removesuffix(".weight")), shape
        if mode == "nvfp4" and in_features % q.NVFP4_BLOCK:
            excluded.append(prefix)
            plan.append((prefix + ".weight", dtype, tuple(shape)))
            continue
        if mode == "fp8":
            plan += [(prefix + ".weight", torch.float8_e4m3fn, (out_features, in_features)),
                     (prefix + ".weight_scale", torch.float32, ())]
        else:
            plan += [(prefix + ".weight", torch.uint8, (out_features, in_features // 2)),
                     (prefix + ".weight_scale", torch.float8_e4m3fn, (out_features, in_features // q.NVFP4_BLOCK)),
                     (prefix + ".weight_scale_2", torch.float32, ())]
        plan.append((prefix + ".input_scale", torch.float32, ()))
    if len(excluded) == config.num_layers * len(LINEAR_NAMES):
        raise ValueError(f"no linear of this target can be {QUANT_ALGOS[mode]}-quantised (input dims are not "
                         f"multiples of {q.NVFP4_BLOCK}); use mode 'fp8'")
    return plan, hf_quant_config(mode, excluded)


def _layer_order(names: list[str], num_layers: int) -> list[str]:
    """Tensors outside the decoder layers first (embedding, final norm, head), then layer by layer."""
    def layer_of(name: str) -> int:
        return int(name.split(".")[1]) if name.startswith("layers.") else -1
    return sorted(names, key=lambda n: (layer_of(n), n))


@torch.inference_mode()
def quantized_tensors(source: TensorSource, config: TargetConfig, mode: q.QuantMode, calibration: Tensor,
                      plan: list[tuple[str, torch.dtype, tuple[int, ...]]]):
    """Yield (HF name, tensor) in ``plan`` order: tensors outside the decoder layers as stored, then each layer's
    tensors, its linears quantised with input scales calibrated on that layer alone.

    Calibration runs the float32 target one layer at a time: the calibration rows' hidden states enter layer
    ``i``, each linear records ``max |input|`` (ModelOpt's max calibrator), and the outputs feed layer ``i+1``;
    memory holds one layer's weights in float32 and the rows' activations, never the model. Per row and per layer
    these are the ops of the whole model's forward, so the amaxes are the same bits.
    Shapes: calibration ``[N, T]`` token ids.
    """
    from dflash_trt.model.kv_cache import StaticKVCache
    from dflash_trt.model.layers import RotaryTable
    from dflash_trt.model.target import TargetLayer, causal_mask

    planned = {name for name, _, _ in plan}
    order = [n.removeprefix("model.") for n, _, _ in plan if not n.endswith(_EXPORT_ONLY)]
    hidden: list[Tensor] = []
    length = calibration.shape[1]
    positions = torch.arange(length).expand(1, length)
    rotary = RotaryTable(config.rope, config.head_dim, length)
    mask = causal_mask(0, length, torch.device("cpu"))
    cache = StaticKVCache(1, 1, config.num_kv_heads, length, config.head_dim, torch.float32, torch.device("cpu"))
    for name in (n for n in order if not n.startswith("layers.")):  # embedding, final norm, head: as stored
        tensor = source.get(_source_key(source, name))
        if name == "embed_tokens.weight":  # the calibration rows enter layer 0
            hidden = [F.embedding(row.view(1, -1), tensor).float() for row in calibration]  # rows, then float
        yield _hf_name(name), tensor
        del tensor
    for index in range(config.num_layers):
        prefix = f"layers.{index}."
        names = [n for n in order if n.startswith(prefix)]
        with torch.device("meta"):
            layer = TargetLayer(config)
        weights = {n.removeprefix(prefix): source.get(_source_key(source, n)) for n in names}
        layer.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True, assign=True)
        amaxes: dict[str, Tensor] = {}
        hooks = []
        for linear in LINEAR_NAMES:
            def record(_module: nn.Module, args: tuple[Tensor, ...], linear: str = linear) -> None:
                seen = q.amax(args[0])
                amaxes[linear] = torch.maximum(amaxes[linear], seen) if linear in amaxes else seen
            hooks.append(layer.get_submodule(linear).register_forward_pre_hook(record))
        try:
            cos, sin = rotary.lookup(positions, torch.float32)
            hidden = [layer(h, cos, sin, cache, 0, 0, mask, None) for h in hidden]
        finally:
            for hook in hooks:
                hook.remove()
        weight_amax = {linear: q.amax(layer.get_submodule(linear).weight) for linear in LINEAR_NAMES}
        if mode == "nvfp4":
            for group in SHARED_INPUT_GROUPS:
                for table in (weight_amax, amaxes):
                    shared = torch.stack([table[linear] for linear in group]).max()
                    table.update(dict.fromkeys(group, shared))
        for name in names:
            stem = _hf_name(name).removesuffix(".weight")
            if stem + ".input_scale" not in planned:  # norms, biases, linears NVFP4 cannot hold: as stored
                yield _hf_name(name), weights[name.removeprefix(prefix)]
                continue
            linear = name.removeprefix(prefix).removesuffix(".weight")
            weight = layer.get_submodule(linear).weight
            if mode == "fp8":
                qweight, scale = q.quantize_fp8(weight, q.fp8_scale(weight_amax[linear]))
                yield stem + ".weight", qweight
                yield stem + ".weight_scale", scale
            else:
                packed, block_scales, global_scale = q.quantize_nvfp4(weight,
                                                                      q.nvfp4_global_scale(weight_amax[linear]))
                yield stem + ".weight", packed
                yield stem + ".weight_scale", block_scales
                yield stem + ".weight_scale_2", global_scale
            yield stem + ".input_scale", q.input_scale(amaxes[linear], mode)
        del layer, weights


_EXPORT_ONLY = (".weight_scale", ".weight_scale_2", ".input_scale")


def quantize_checkpoint(source: TensorSource, config: TargetConfig, mode: q.QuantMode, calibration: Tensor,
                        folder: Path, tokenizer_file: Path | None = None) -> tuple[Path, dict]:
    """Write the ModelOpt export folder of a checkpoint, tensor by tensor (:func:`quantized_tensors` into a
    :class:`SafetensorsWriter`): peak memory is one layer in float32 plus the calibration activations, whatever the
    model's size. Returns (folder, ``hf_quant_config``)."""
    folder = Path(folder)
    plan, quant_config = quantization_plan(source, config, mode)
    folder.mkdir(parents=True, exist_ok=True)
    _write_configs(folder, config, quant_config, tokenizer_file)
    with SafetensorsWriter(folder / "model.safetensors", plan, metadata={"format": "pt"}) as out:
        for name, tensor in quantized_tensors(source, config, mode, calibration, plan):
            out.write(name, tensor)
    return folder, quant_config


def hf_quant_config(mode: q.QuantMode, excluded: Sequence[str] = ()) -> dict:
    """``hf_quant_config.json`` as ModelOpt 0.47.0 writes it; ``exclude_modules`` sorted as it sorts them."""
    quantization: dict[str, Any] = {"quant_algo": QUANT_ALGOS[mode], "kv_cache_quant_algo": None}
    if mode == "nvfp4":
        quantization["group_size"] = q.NVFP4_BLOCK
    quantization["exclude_modules"] = sorted({*ALWAYS_EXCLUDED, *excluded})
    return {"producer": {"name": "dflash_trt", "version": __version__}, "quantization": quantization}


def quantization_config(quant_config: dict) -> dict:
    """The ``config.json`` ``quantization_config`` block ModelOpt derives from ``hf_quant_config`` (FP8, NVFP4)."""
    details = quant_config["quantization"]
    algo = details["quant_algo"]
    if algo == "FP8":
        spec: dict[str, Any] = {"dynamic": False, "num_bits": 8, "type": "float"}
        group = {"input_activations": spec, "weights": dict(spec), "targets": ["Linear"]}
    else:
        spec = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": details["group_size"]}
        group = {"input_activations": spec, "weights": dict(spec), "targets": ["Linear"]}
    return {"config_groups": {"group_0": group}, "ignore": list(details["exclude_modules"]), "quant_algo": algo,
            "producer": quant_config["producer"], "quant_method": "modelopt"}


def save_quantized_target(folder: str | Path, config: TargetConfig, state: dict[str, Tensor], quant_config: dict,
                          tokenizer_file: Path | None = None) -> Path:
    """Write ``config.json``, ``hf_quant_config.json`` and ``model.safetensors`` (+ a copy of ``tokenizer_file``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _write_configs(folder, config, quant_config, tokenizer_file)
    save_file({name: t.contiguous() for name, t in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def _write_configs(folder: Path, config: TargetConfig, quant_config: dict, tokenizer_file: Path | None) -> None:
    hf_config = target_config_json(config) | {"quantization_config": quantization_config(quant_config)}
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (folder / "hf_quant_config.json").write_text(json.dumps(quant_config, indent=4) + "\n")
    if tokenizer_file is not None:
        import shutil

        shutil.copyfile(tokenizer_file, folder / tokenizer_file.name)


def load_quantized_target(folder: str | Path, activations: Activations = "float",
                          fp8_gemm: bool = False) -> tuple[TargetModel, Tokenizer | None]:
    """Read an export folder into a ``TargetModel`` whose decoder linears run the stored quantised weights.

    ``fp8_gemm`` runs FP8 linears through ``torch._scaled_mm`` (:class:`Fp8Linear`) instead of a
    float GEMM on dequantised weights. The tokenizer is ``tokenizer.json`` or ``tok512.bin`` beside it.
    """
    folder = Path(folder)
    config = parse_target_config(read_json(folder / "config.json", "target config.json"), str(folder / "config.json"))
    quant_config = read_json(folder / "hf_quant_config.json", "hf_quant_config.json")
    state = read_tensors(safetensors_files(folder))
    model = dequantize_into(TargetModel(config), state, quant_config, activations, fp8_gemm, source=str(folder))
    tokenizer: Tokenizer | None = None
    if (folder / "tokenizer.json").is_file():
        tokenizer = HFTokenizer(folder / "tokenizer.json")
    elif (folder / "tok512.bin").is_file():
        tokenizer = Llama2cTokenizer(folder / "tok512.bin")
    return model.eval(), tokenizer


def dequantize_into(model: TargetModel, state: dict[str, Tensor], quant_config: dict,
                    activations: Activations = "float", fp8_gemm: bool = False,
                    source: str = "quantized state") -> TargetModel:
    """Load an export state dict into ``model``: plain tensors as they are, quantised linears as modules.

    With ``activations="quantized"`` (and not ``fp8_gemm``) the model's float ops become batch-invariant
    (``batch_invariant.make_batch_invariant``), so a verify forward's rows are the bits of 1-token steps.
    Every tensor must be used and every parameter filled (strict), or ``CheckpointFormatError`` names them.
    """
    details = quant_config.get("quantization", {})
    algo = details.get("quant_algo")
    modes = {v: k for k, v in QUANT_ALGOS.items()}
    if algo not in modes:
        raise CheckpointFormatError(f"{source}: hf_quant_config `quantization.quant_algo` is {algo!r}; expected one "
                                    f"of {sorted(modes)}. Fix: export with --quantize fp8 or nvfp4.")
    mode = modes[algo]
    remaining = dict(state)
    for index, layer in enumerate(model.layers):
        for name in LINEAR_NAMES:
            prefix = f"model.layers.{index}.{name}"
            if prefix + ".weight_scale" not in remaining:
                continue  # excluded: a plain float linear, loaded below
            tensors = {key.removeprefix(prefix + "."): remaining.pop(key) for key in list(remaining)
                       if key.startswith(prefix + ".")}
            parent_name, _, child = name.rpartition(".")
            linear = layer.get_submodule(name)
            module = _quantized_module(mode, tensors, tuple(linear.weight.shape), activations, fp8_gemm,
                                       f"{source}: {prefix}")
            setattr(layer.get_submodule(parent_name), child, module)
    plain = {key.removeprefix("model."): tensor for key, tensor in remaining.items()}
    quantized = {name for name, module in model.named_modules()
                 if isinstance(module, (QuantizedLinear, IntegerQuantizedLinear, Fp8Linear))}
    expected = {k: v for k, v in model.state_dict().items() if k.rpartition(".")[0] not in quantized}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    check_state_dict(expected, plain, source)
    model.load_state_dict({k: v.float() for k, v in plain.items()}, strict=False)
    if activations == "quantized" and not fp8_gemm:
        make_batch_invariant(model)  # the float ops feeding the quantisers, docs/quantization.md §4.1
    return model


def _quantized_module(mode: q.QuantMode, tensors: dict[str, Tensor], shape: tuple[int, int], activations: Activations,
                      fp8_gemm: bool, where: str) -> nn.Module:
    """Check one linear's stored tensors against docs/serving-notes.md §3.1 and build its runtime module."""
    out_features, in_features = shape
    expected = {"weight": ((out_features, in_features), torch.float8_e4m3fn), "weight_scale": ((), torch.float32),
                "input_scale": ((), torch.float32)}
    if mode == "nvfp4":
        expected |= {"weight": ((out_features, in_features // 2), torch.uint8),
                     "weight_scale": ((out_features, in_features // q.NVFP4_BLOCK), torch.float8_e4m3fn),
                     "weight_scale_2": ((), torch.float32)}
    if "bias" in tensors:
        expected["bias"] = ((out_features,), tensors["bias"].dtype)
    if set(tensors) != set(expected):
        raise CheckpointFormatError(f"{where}: holds {sorted(tensors)}; expected {sorted(expected)} for "
                                    f"{QUANT_ALGOS[mode]}. Fix: re-export the checkpoint.")
    for key, (want_shape, want_dtype) in expected.items():
        if tuple(tensors[key].shape) != want_shape or tensors[key].dtype != want_dtype:
            raise CheckpointFormatError(f"{where}.{key}: is {tensors[key].dtype} {tuple(tensors[key].shape)}; "
                                        f"expected {want_dtype} {want_shape} (docs/serving-notes.md §3.1). "
                                        "Fix: re-export.")
    bias = tensors["bias"].float() if "bias" in tensors else None
    if mode == "fp8" and fp8_gemm:
        return Fp8Linear(tensors["weight"], tensors["weight_scale"], tensors["input_scale"], bias)
    if activations == "quantized":
        return IntegerQuantizedLinear(mode, tensors, bias)
    if mode == "fp8":
        weight = q.dequantize_fp8(tensors["weight"], tensors["weight_scale"])
    else:
        weight = q.dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])
    return QuantizedLinear(weight, bias)


class QuantizedLinear(nn.Module):
    """Weight-only execution of a quantised linear: a float32 GEMM on the dequantised weight.

    Shapes: weight ``[out, in]`` (dequantised, float32); forward ``[..., in] -> [..., out]``.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class IntegerQuantizedLinear(nn.Module):
    """W8A8 / W4A4 emulation that is batch-invariant: what a quantised GEMM computes, summed exactly.

    The input is quantised with the static ``input_scale`` (per token: FP8 per element, NVFP4 in
    dynamic 16-element blocks), and both operands become exact integers (``quantize.fp8_units`` /
    ``nvfp4_units``), so the dot products are int64 sums that do not depend on how many rows the
    GEMM has or in which order it adds (``quantize.exact_quantized_matmul``). A float32 GEMM on the
    dequantised tensors rounds differently for 1 and for k+1 rows, and a static quantiser turns
    those last-bit differences into whole grid steps (docs/quantization.md §4.1).
    Shapes: forward ``[..., in] -> [..., out]`` float32.
    """

    def __init__(self, mode: q.QuantMode, tensors: dict[str, Tensor], bias: Tensor | None) -> None:
        super().__init__()
        self.mode = mode
        if mode == "fp8":
            units, unit = q.fp8_units(tensors["weight"]), tensors["weight_scale"].double() / q.FP8_UNITS_PER_ONE
        else:
            units = q.nvfp4_units(tensors["weight"], tensors["weight_scale"])
            unit = tensors["weight_scale_2"].double() / q.NVFP4_UNITS_PER_ONE
        self.register_buffer("weight_units", units)  # [out, in] int64
        self.register_buffer("weight_unit", unit)  # [] float64
        self.register_buffer("input_scale", tensors["input_scale"].float())
        self.register_buffer("bias", bias)

    def forward(self, x: Tensor) -> Tensor:
        x_units, x_unit = q.quantized_input_units(x, self.mode, self.input_scale)
        out = q.exact_quantized_matmul(x_units, x_unit, self.weight_units, self.weight_unit).to(x.dtype)
        return out if self.bias is None else out + self.bias


class Fp8Linear(nn.Module):
    """FP8 W8A8 linear as served on a GPU: ``_scaled_mm(fp8(x / s_x), W_q^T, s_x, s_w)`` with fp32 output.

    torch 2.13 runs ``_scaled_mm`` on CPU too (docs/environment.md §4.1). Shapes: qweight float8_e4m3fn
    ``[out, in]``; forward ``[..., in] -> [..., out]`` float32.
    """

    def __init__(self, qweight: Tensor, weight_scale: Tensor, input_scale: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer("input_scale", input_scale.float())
        self.register_buffer("bias", bias)

    def forward(self, x: Tensor) -> Tensor:
        flat = q.cast_fp8(x.reshape(-1, x.shape[-1]).float() / self.input_scale)
        out = torch._scaled_mm(flat, self.qweight.t(), scale_a=self.input_scale, scale_b=self.weight_scale,
                               bias=self.bias, out_dtype=torch.float32)
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)


def _hf_name(name: str) -> str:
    """Our state-dict key -> the HF checkpoint key (``model.`` prefix except ``lm_head``)."""
    return name if name.startswith("lm_head.") else "model." + name
