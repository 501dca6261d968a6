"""``python -m dflash_trt ...`` runs the ``dflash-trt`` command, so ``torchrun -m dflash_trt train ...`` works."""

from dflash_trt.cli import entry

if __name__ == "__main__":
    entry()
