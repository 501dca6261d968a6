"""Forward costs of simulated machines: what a target or draft forward of given rows costs, in seconds.

A *regime* prices one forward from its rows, each ``(context, width)`` (positions already cached, tokens
computed), and the host time of a scheduler step outside its forwards:

- ``cpu``: the embedded stories260K pair's ONNX Runtime engine on this repository's 2-core Xeon, from the costs
  ``dflash-trt bench`` measured (docs/benchmarks.md, "Engines": plain step 0.58 ms, verify(16) 0.81 ms, draft(16)
  0.69 ms and 0.32 ms of other work per cycle at c=1; a 16-row x 16-token verify 5.5-8 ms; plain decoding at c=16 ~5x
  its c=1 throughput; attention ~14 ns per key, head and layer), as a base plus a per-token term (tests/cost_tables.py's
  form). A verify that hands over context taps (some row keeps a drafter) costs 11 us more per row: plain steps of
  drafting requests took 1.73 ms against plain requests' 1.55 ms at batch 16 (``tools/plain_steps_ab.py``,
  docs/adaptive-notebook.md, "Waiting for a guess"). Draft calls are priced batched (the torch backend's; the engine's
  drafter takes one request per call, which makes drafting dearer at c > 1 than here), the rows taking in a prompt in a
  call of their own as every backend makes them. These are the machine's slower state: on a fast stretch of a later day
  plain steps at c=1 ran 0.34 ms and k=7 and k=15 steps cost 3.2 and 3.9 of them (here 2.55 and 3.2;
  ``tools/auto_trace.py --steps``, docs/adaptive-notebook.md, "The engine at c=1 on a noisy day").
- ``cpu-torch``: the same pair on the torch backend (eager, float32, one thread) on a 2-core Xeon with AVX-512 and AMX,
  from the steady steps of the bars' torch command (``tools/auto_trace.py --steps``; docs/adaptive-notebook.md, "The
  torch c=16 cell on a noisier machine"): plain step 1.62 ms at c=1 (verify 1.48 + 0.13) and 3.61 ms at batch 16 (verify
  3.31 + 0.30), a k=15 cycle 4.60 ms at c=1 (verify 2.14, draft 2.12, 0.30 other), a k=7 step at batch 16 14.1 ms
  (verify 6.66, draft 6.49, 0.76 other). Here a draft costs about what the verify of the same tokens does (the
  drafter's 3 layers have a 512-wide MLP, the target's 5 a 172-wide one), so at c=16 every length loses to plain
  decoding in steady state (k=7 ~0.96x on stories) where on the engine's ``cpu`` it wins: the regime of the torch
  bars' c=16 cell (static k=15 0.63-0.72x plain there, 0.62-0.73x here on the bench's own prompts). Context taps cost
  5 us a row (one measurement of a 16-row verify, by a script not kept: 3.03 ms with them, 2.96 ms without).
- ``cpu-0.6b``: a Qwen3-0.6B-shaped target with a 1-layer drafter (tools/make_checkpoints.py), torch eager
  float32 on the same CPU, from one ``dflash-trt bench ... --concurrency 1 --max-new-tokens 32`` cell: plain
  verify 142 ms, verify(16) 389 ms, draft(16) 177 ms, 0.2 ms / 2.2 ms of other work per plain / drafting
  step. A cycle costs ~4x a plain step: the case where a cold session's probes hurt most. Context taps are not
  priced here (a few tens of microseconds a row against a 142 ms verify).
- roofline (``h200-1k``, ``h200-32k``): an 8B bf16 target (Qwen3-8B's shape) and a ~1B bf16 drafter on an
  H200-class GPU: each forward costs ``max(bytes / bandwidth, flops / peak)`` plus a fixed launch overhead,
  where bytes are the weights plus the KV cache each row reads (growing with its context) plus, when it hands
  over context taps, the tapped hidden states it writes (5 layers x 4096 x bf16 a token), and flops are
  2 x parameters per token plus attention over the context. Host work per step: 0.3 ms + 5 us per row (plain),
  0.5 ms + 15 us per row (drafting), assumed.
- ``compute-bound``: the same at 35% of the peak FLOP rate, so a forward is compute-bound from ~70 tokens
  (batch x width) on: high-batch drafting pays for every drafted token.

Noise and load bursts are not here: the simulated backend multiplies these costs by them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Linear:
    """A compute-bound CPU: a forward costs a base plus a per-token term (tests/cost_tables.py's form) plus
    attention per cached key and row; a context tap taken in by the drafter costs a quarter of a block token
    (it skips the MLPs and the LM head)."""

    verify_base: float
    verify_token: float
    draft_base: float
    draft_token: float
    key_s: float  # per row and cached key
    step_s: float  # host time of a plain step ...
    step_row_s: float  # ... plus this per row
    drafting_s: float  # host time of a drafting step ...
    drafting_row_s: float  # ... plus this per row
    tap_row_s: float = 0.0  # per row of a verify that hands over context taps


@dataclass(frozen=True)
class Regime:
    """A simulated machine and model pair (see the module docstring); ``context`` is the prompt length served
    (None: each request's recorded prompt)."""

    name: str
    description: str
    context: int | None
    linear: Linear | None = None  # None: the roofline below
    efficiency: float = 1.0  # roofline: fraction of the peak FLOP rate reached

    # ---- roofline: H200-class GPU, Qwen3-8B-shaped target, ~1B drafter (bf16) ----
    bandwidth = 4.8e12  # bytes/s (HBM3e)
    peak_flops = 990e12  # dense bf16 FLOP/s
    launch_s = 50e-6  # per forward: kernel launches of a captured graph / engine enqueue
    target_params = 8.2e9
    target_kv_bytes = 36 * 8 * 128 * 2 * 2  # per cached token: layers x KV heads x head dim x (K, V) x bf16
    target_attn_flops = 4 * 36 * 32 * 128  # per token and key: QK^T and PV over layers x query heads x head dim
    draft_params = 1.0e9  # its own layers and the (shared) LM head it reads
    draft_kv_bytes = 5 * 8 * 128 * 2 * 2
    draft_attn_flops = 4 * 5 * 32 * 128
    draft_tap_flops = 2 * 0.126e9  # per context tap taken in: the fc projection and the K/V projections
    target_tap_bytes = 5 * 4096 * 2  # per token of a verify that hands over context taps: 5 layers' hidden, bf16
    gpu_step_s = 300e-6  # host work of a plain step (sampling, bookkeeping) ...
    gpu_step_row_s = 5e-6  # ... plus this per row
    gpu_drafting_s = 500e-6  # host work of a drafting step (acceptance, draft ids to the host) ...
    gpu_drafting_row_s = 15e-6  # ... plus this per row

    def verify(self, rows: list[tuple[int, int]], taps: bool = False) -> float:
        """A target forward over ``rows`` of ``(context, width)``; ``taps``: it hands over context taps (some row
        keeps a drafter), for every row."""
        tokens = sum(w for _, w in rows)
        if self.linear is not None:
            cpu = self.linear
            return (cpu.verify_base + cpu.verify_token * tokens + cpu.key_s * sum(c + w for c, w in rows)
                    + (cpu.tap_row_s * len(rows) if taps else 0.0))
        nbytes = (2 * self.target_params + self.target_kv_bytes * sum(c + w for c, w in rows)
                  + (self.target_tap_bytes * tokens if taps else 0))
        flops = 2 * self.target_params * tokens + self.target_attn_flops * sum(w * (c + w) for c, w in rows)
        return self.launch_s + max(nbytes / self.bandwidth, flops / (self.peak_flops * self.efficiency))

    def draft(self, rows: list[tuple[int, int, int]]) -> float:
        """A draft forward over ``rows`` of ``(context, width, taps)``: a block of ``width`` tokens after
        ``context`` positions, taking in ``taps`` new context positions first."""
        if self.linear is not None:
            cpu = self.linear
            tokens = sum(w + t / 4 for _, w, t in rows)
            return cpu.draft_base + cpu.draft_token * tokens + cpu.key_s * sum(c + w for c, w, _ in rows)
        nbytes = 2 * self.draft_params + self.draft_kv_bytes * sum(c + w for c, w, _ in rows)
        flops = sum(2 * self.draft_params * w + self.draft_tap_flops * t + self.draft_attn_flops * w * (c + w)
                    for c, w, t in rows)
        return self.launch_s + max(nbytes / self.bandwidth, flops / (self.peak_flops * self.efficiency))

    def host(self, drafting: bool, batch: int) -> float:
        """A scheduler step's time outside its forwards."""
        if self.linear is not None:
            cpu = self.linear
            return cpu.drafting_s + cpu.drafting_row_s * batch if drafting else cpu.step_s + cpu.step_row_s * batch
        return (self.gpu_drafting_s + self.gpu_drafting_row_s * batch if drafting
                else self.gpu_step_s + self.gpu_step_row_s * batch)

    def plain_step(self) -> float:
        """A batch-1 plain step at the served context: the unit load bursts are timed in."""
        return self.verify([(self.context or 64, 1)]) + self.host(False, 1)


EMBEDDED_ORT = Linear(verify_base=0.405e-3, verify_token=0.025e-3, draft_base=0.30e-3, draft_token=0.024e-3,
                      key_s=5 * 8 * 14e-9, step_s=0.09e-3, step_row_s=0.06e-3, drafting_s=0.26e-3,
                      drafting_row_s=0.12e-3, tap_row_s=11e-6)
QWEN3_06B_TORCH = Linear(verify_base=125.8e-3, verify_token=16.4e-3, draft_base=60e-3, draft_token=7.3e-3,
                         key_s=0.0, step_s=0.2e-3, step_row_s=0.05e-3, drafting_s=2.1e-3, drafting_row_s=0.1e-3)

EMBEDDED_TORCH = Linear(verify_base=1.45e-3, verify_token=0.030e-3, draft_base=1.71e-3, draft_token=0.024e-3,
                        key_s=0.79e-6, step_s=0.12e-3, step_row_s=0.011e-3, drafting_s=0.27e-3,
                        drafting_row_s=0.03e-3, tap_row_s=5e-6)

REGIMES = {
    "cpu": Regime("cpu", "embedded stories260K pair, ONNX Runtime engine, 2-core Xeon (measured costs)", None,
                  EMBEDDED_ORT),
    "cpu-torch": Regime("cpu-torch", "embedded stories260K pair, torch eager fp32, 2-core Xeon (measured costs)", None,
                        EMBEDDED_TORCH),
    "cpu-0.6b": Regime("cpu-0.6b", "Qwen3-0.6B-shaped target + 1-layer drafter, torch eager fp32, 2-core Xeon "
                       "(measured costs)", None, QWEN3_06B_TORCH),
    "h200-1k": Regime("h200-1k", "8B bf16 target + 1B drafter, H200 roofline, 1k-token prompts", 1024),
    "h200-32k": Regime("h200-32k", "8B bf16 target + 1B drafter, H200 roofline, 32k-token prompts", 32768),
    "compute-bound": Regime("compute-bound", "8B bf16 target + 1B drafter, H200 bandwidth at 35% of the peak "
                            "FLOP rate, 1k-token prompts", 1024, efficiency=0.35),
}
