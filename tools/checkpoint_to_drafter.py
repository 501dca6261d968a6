"""Write the drafter held by a training checkpoint (``OUT/checkpoints/state.pt``) as a z-lab drafter folder.

    .venv/bin/python tools/checkpoint_to_drafter.py OUT/checkpoints/state.pt --like OUT_OR_ANY_DRAFTER --out DIR

A checkpoint stores the drafter's weights and optimiser state but not its config; ``--like`` names a drafter
folder of the same shape (the run's own output, or the ``config.json`` a same-flag run wrote) whose config is
reused. Prints the checkpoint's step. Used to compare two runs at the same step before both finish
(docs/drafters.md, DFlash2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dflash_trt.formats.draft_checkpoint import load_draft_checkpoint, save_draft_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--like", type=Path, required=True, help="a drafter folder of the same config")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    saved = torch.load(args.checkpoint, weights_only=True)
    head = load_draft_checkpoint(args.like)
    head.load_state_dict(saved["state"]["head"])
    save_draft_checkpoint(head.eval(), args.out)
    print(f"step {saved['state']['step']} -> {args.out}")


if __name__ == "__main__":
    main()
