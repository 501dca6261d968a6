"""Small in-memory models for the training tests (float32, CPU, seeded; no files)."""

from __future__ import annotations

import torch

from dflash_trt.config import RopeConfig, TargetConfig
from dflash_trt.model.target import TargetModel

MASK_TOKEN_ID = 0


def tiny_target(seed: int = 0, vocab: int = 64, layers: int = 4) -> TargetModel:
    """A random Llama-style target (H=32, 4/2 heads of 8); logits scaled up so its argmax is decisive."""
    config = TargetConfig(family="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=layers,
                          num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope=RopeConfig(theta=10000.0),
                          max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TargetModel(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 2:
                    param.normal_(0.0, 0.3)
                else:
                    param.uniform_(0.8, 1.2)
    return model.eval()
