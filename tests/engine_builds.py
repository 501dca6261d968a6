"""Engine folders shared by the builder and plugin tests: built once per test session (ONNX export is slow).

The pair is the real stories260K target (llama2.c, GQA 8/4, tied head) with a random 2-layer drafter
whose second layer is a sliding-window layer, so the graphs exercise every attention path.

``cli_built_engine`` runs the same request through ``dflash-trt build``; ``built_engine`` of the same name then
reuses that folder (an engine build is most of a builder test's time: "trt" and "ort-standard" are built once).
"""

from __future__ import annotations

from pathlib import Path

import torch

_CACHE: dict[str, Path] = {}
_CLI_BUILDS: dict[str, tuple] = {}  # name -> (click result, engine folder)


def stories_drafter(root: Path, sliding: bool = True, is_causal: bool | None = None) -> Path:
    """A random z-lab drafter for stories260K (2 taps, block 4): a full and a sliding-window layer, or with
    ``sliding=False`` two full layers (bidirectional in-block, or causal with ``is_causal``)."""
    key = f"drafter-{sliding}-{is_causal}"
    if key not in _CACHE:
        from dflash_trt.formats.draft_checkpoint import save_draft_checkpoint
        from dflash_trt.formats.load import embedded_target_path, load_target
        from dflash_trt.config import DraftConfig
        from dflash_trt.model.draft_head import DraftHead, build_target_layer_ids

        target, _ = load_target(embedded_target_path())
        t = target.config
        config = DraftConfig(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_layers=2,
                             num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
                             rms_norm_eps=t.rms_norm_eps, rope=t.rope, vocab_size=t.vocab_size,
                             max_position_embeddings=t.max_position_embeddings, num_target_layers=t.num_layers,
                             target_layer_ids=build_target_layer_ids(t.num_layers, 2), block_size=4, mask_token_id=0,
                             layer_sliding=(False, sliding), sliding_window=5 if sliding else None,
                             is_causal=is_causal)
        torch.manual_seed(7)
        head = DraftHead(config)
        with torch.no_grad():  # larger weights: draft logits far from uniform, so parity is meaningful
            for param in head.parameters():
                if param.dim() > 1:
                    param.mul_(3.0)
        _CACHE[key] = save_draft_checkpoint(head, root / f"stories-{key}")
    return _CACHE[key]


def built_engine(root: Path, name: str, drafter: dict | None = None, **fields) -> Path:
    """``build_engine`` for stories260K + ``stories_drafter(**drafter)`` once per ``name`` (fields go to
    BuildConfig)."""
    if name not in _CACHE:
        from dflash_trt.builder.engine import BuildConfig, build_engine
        from dflash_trt.formats.load import embedded_target_path

        cli = _CLI_BUILDS.get(name)
        reuse = cli is not None and cli[0].exit_code == 0  # a failed CLI build fails the CLI test only
        out = root / name if cli is None or reuse else root / f"{name}-lib"
        config = BuildConfig(target=embedded_target_path(), draft=stories_drafter(root, **(drafter or {})),
                             out=out, **fields)
        if reuse:  # the same folder only if it was the same request
            from dflash_trt.formats.manifest import read_manifest

            command = read_manifest(cli[1]).build.command
            assert command == config.command(), f"{name}: the CLI built `{command}`, expected `{config.command()}`"
            _CACHE[name] = cli[1]
        else:
            _CACHE[name] = build_engine(config).folder
    return _CACHE[name]


def cli_built_engine(root: Path, name: str, *flags: str):
    """``dflash-trt build`` (through click) of stories260K + ``stories_drafter(root)`` with ``flags``, once per
    ``name``: (the click result, the engine folder). The folder is ``root / name`` unless ``built_engine`` built that
    name first; ``built_engine(root, name, ...)`` later reuses it after checking that the manifest's recorded command
    is the one its own fields give."""
    if name not in _CLI_BUILDS:
        from click.testing import CliRunner

        from dflash_trt.cli import main
        from dflash_trt.formats.load import embedded_target_path

        out = root / (name if name not in _CACHE else f"{name}-cli")
        args = ["build", "--target", str(embedded_target_path()), "--draft", str(stories_drafter(root)),
                "--out", str(out), *flags]
        _CLI_BUILDS[name] = (CliRunner().invoke(main, args), out)
    return _CLI_BUILDS[name]
