"""Regenerate the frozen nvidia-modelopt reference vectors in ``tests/model/data/`` (run in a side venv).

The project never depends on modelopt; this script produces the bytes our quantiser must match:

- ``nvfp4_vectors.safetensors``: inputs and ``NVFP4QTensor.quantize`` / ``.dequantize`` outputs for
  hand-made edge cases (every e2m1 grid point and midpoint, saturation, tiny negatives, all-zero
  and tiny blocks) and random weights spanning six decades.
- ``modelopt_stories260K.json``: ``mtq.quantize`` (max calibration) + ``export_hf_checkpoint`` of the
  embedded stories260K as an HF ``LlamaForCausalLM``, per mode (FP8, NVFP4 with ``*down_proj*``
  disabled because its 172 inputs are not a multiple of 16): the calibration token ids, every
  exported tensor's dtype, shape and sha256, the ``input_scale`` values, ``hf_quant_config.json``
  and ``config.json``'s ``quantization_config``.

Setup (torch first, exact pin, so pip keeps the CPU wheel; docs/environment.md §7.2)::

    python3 -m venv /tmp/venv-modelopt
    /tmp/venv-modelopt/bin/pip install torch==2.13.0
    /tmp/venv-modelopt/bin/pip install nvidia-modelopt requests "transformers<5.15"
    /tmp/venv-modelopt/bin/python tools/make_modelopt_vectors.py      # from the repository root
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_trt.formats.load import embedded_target_path, load_target  # noqa: E402
from dflash_trt.formats.hf_config import target_config_json  # noqa: E402
from dflash_trt.formats.quantized_checkpoint import calibration_batch  # noqa: E402

DATA = ROOT / "tests" / "builder" / "data"
CALIBRATION_TEXTS = ROOT / "data" / "tinystories" / "calibration-paragraphs.txt"
CALIBRATION_ROWS, CALIBRATION_LENGTH = 16, 64


def nvfp4_cases() -> dict[str, torch.Tensor]:
    """Edge-case and random weights, with modelopt's NVFP4 outputs for each."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    midpoints = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    beyond = [6.5, 7.0, 100.0, 1e-3, 0.2499, 0.2501, 2.4999, 2.5001, 3.4999, 3.5001]
    row = grid + midpoints + beyond + [-0.0, -0.1]
    row = row + [0.0] * (32 - len(row))
    exact = torch.tensor([row, [-v for v in row]], dtype=torch.float32)  # [2, 32], unit scales: q = e2m1(w)
    generator = torch.Generator().manual_seed(1234)
    random = torch.randn(32, 128, generator=generator) * torch.logspace(-4, 2, 32).unsqueeze(1)
    random[0, :16] = 0.0  # all-zero block -> block scale 1.0
    random[1, :16] = 1e-9  # tiny block -> scale clamped to 2^-9
    random[2, 16:32] = -random[2, 16:32].abs()  # all-negative block
    cases = {}
    for name, weight, block_scale, global_scale in [
        ("exact", exact, torch.ones(2, 2).to(torch.float8_e4m3fn), torch.tensor(1.0)),
        ("random", random, None, None),
    ]:
        qtensor, block_scale, global_scale = NVFP4QTensor.quantize(weight.clone(), 16, block_scale, global_scale)
        dequantized = qtensor.dequantize(dtype=torch.float32, scale=block_scale, double_scale=global_scale,
                                         block_sizes={-1: 16})
        cases |= {f"{name}.input": weight, f"{name}.weight": qtensor._quantized_data,
                  f"{name}.weight_scale": block_scale, f"{name}.weight_scale_2": global_scale.reshape(()),
                  f"{name}.dequantized": dequantized}
    return cases


def export_stories260k(mode: str, calibration: torch.Tensor) -> dict:
    """modelopt's unified HF export of stories260K, summarised as digests."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    ours, _ = load_target(embedded_target_path())
    config = LlamaConfig(**{k: v for k, v in target_config_json(ours.config).items()
                            if k not in ("dtype", "rope_scaling")})
    model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict({("" if k.startswith("lm_head") else "model.") + k: v
                                                 for k, v in ours.state_dict().items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    with torch.no_grad():  # the HF model and ours must be the same function
        cache = ours.new_cache(1, calibration.shape[1])
        diff = (model(calibration[:1]).logits - ours(calibration[:1], 0, cache)[0]).abs().max().item()
    print(f"HF vs dflash_trt logits max |diff| = {diff:.2e}")
    assert diff < 1e-4

    quant_cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG if mode == "fp8" else mtq.NVFP4_DEFAULT_CFG)
    if mode == "nvfp4":
        quant_cfg["quant_cfg"].append({"quantizer_name": "*down_proj*", "enable": False})

    def forward_loop(m: torch.nn.Module) -> None:
        for row in calibration:
            m(row.view(1, -1), use_cache=False)

    model = mtq.quantize(model, quant_cfg, forward_loop)
    with tempfile.TemporaryDirectory() as out:
        export_hf_checkpoint(model, export_dir=out)
        hf_quant = json.loads((Path(out) / "hf_quant_config.json").read_text())
        quantization_config = json.loads((Path(out) / "config.json").read_text())["quantization_config"]
        tensors = {}
        with safe_open(str(Path(out) / "model.safetensors"), "pt") as handle:
            for name in sorted(handle.keys()):
                tensor = handle.get_tensor(name)
                raw = tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                entry = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                         "sha256": hashlib.sha256(raw).hexdigest()}
                if tensor.dim() == 0:  # the scalar scales, readable in the file
                    entry["value"] = tensor.item()
                tensors[name] = entry
    return {"hf_quant_config": hf_quant, "quantization_config": quantization_config, "tensors": tensors}


def main() -> None:
    import modelopt
    from safetensors.torch import save_file

    DATA.mkdir(parents=True, exist_ok=True)
    save_file(nvfp4_cases(), str(DATA / "nvfp4_vectors.safetensors"),
              metadata={"producer": f"nvidia-modelopt {modelopt.__version__} NVFP4QTensor"})
    _, tokenizer = load_target(embedded_target_path())
    paragraphs = [line for line in CALIBRATION_TEXTS.read_text().splitlines() if line.strip()]
    calibration = calibration_batch(tokenizer, paragraphs[:4 * CALIBRATION_ROWS], CALIBRATION_LENGTH)[:CALIBRATION_ROWS]
    summary = {"modelopt_version": modelopt.__version__, "torch_version": torch.__version__,
               "calibration": calibration.tolist(),
               "modes": {mode: export_stories260k(mode, calibration) for mode in ("fp8", "nvfp4")}}
    (DATA / "modelopt_stories260K.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {DATA}")


if __name__ == "__main__":
    main()
