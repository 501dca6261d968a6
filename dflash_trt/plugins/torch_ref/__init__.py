"""The torch reference backend (float32 by default): the models of ``dflash_trt.model`` run eagerly."""
