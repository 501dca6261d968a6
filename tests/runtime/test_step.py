"""One batched step (dflash_trt/runtime/step.py): one host read per step, measurement only when subscribed.

The host-read count wraps every way torch hands a tensor's values to Python (``item``, ``tolist``,
``int()``/``float()``/``bool()``/``__index__``), and every copy to host memory (``cpu``, ``numpy``/``__array__``,
``to`` a CPU device) of a tensor that is not already there, while the scheduler's worker runs a step on the torch
backend, and requires exactly one per step: the verdicts' transfer. (A CPU tensor's ``numpy()`` is a view of the same
memory, not a copy: ``sampling.argmax_rows`` takes numpy's argmax on a CPU for speed, and never on a GPU.)
On a GPU every such read is a device sync; one per step means nothing waits between the draft and the verify calls.
(Reads inside torch's C++ ops are not seen here; the step uses none that sync on CUDA: no boolean-mask indexing,
``nonzero`` or data-dependent shapes.)
"""

from __future__ import annotations

import threading

import pytest
import torch

from dflash_trt.config import SamplingParams
from dflash_trt.runtime.policy import SpeculationConfig
from dflash_trt.runtime.session import Session

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went", "One day, a bird"]
READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")  # values to Python, on any device
COPIES = ("cpu", "numpy", "__array__")  # to host memory: a read where the tensor is not there already


@pytest.fixture(scope="module")
def sessions():
    """Static and ``auto`` sessions of the embedded pair with 16 slots (torch backend, eager)."""
    static = Session.from_checkpoints(max_batch=16)
    auto = Session.from_checkpoints(max_batch=16, speculation=SpeculationConfig(mode="auto"))
    yield {"static": static, "auto": auto}
    static.close()
    auto.close()


class HostReads:
    """Counts the host reads of tensors made by the scheduler's worker during each ``Scheduler._step``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, session: Session) -> None:
        self.per_step: list[int] = []
        self.what: list[list[str]] = []
        self._inside = threading.local()
        scheduler = session._scheduler
        step = scheduler._step

        def counted_step() -> None:
            self._inside.reads = []
            try:
                step()
            finally:
                reads, self._inside.reads = self._inside.reads, None
                self.per_step.append(len(reads))
                self.what.append(reads)

        monkeypatch.setattr(scheduler, "_step", counted_step)
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        for name in COPIES:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name), off_cpu=True))
        to = torch.Tensor.to

        def counted_to(tensor, *args, **kwargs):
            moved = to(tensor, *args, **kwargs)
            if moved.device.type == "cpu" and tensor.device.type != "cpu":
                self._note("to")
            return moved

        monkeypatch.setattr(torch.Tensor, "to", counted_to)

    def _note(self, name: str) -> None:
        reads = getattr(self._inside, "reads", None)
        if reads is not None:
            reads.append(name)

    def _wrap(self, name: str, method, off_cpu: bool = False):
        def counted(tensor, *args, **kwargs):
            if not off_cpu or tensor.device.type != "cpu":
                self._note(name)
            return method(tensor, *args, **kwargs)

        return counted


def requests(batch: int, sampled: bool) -> list[tuple[str, SamplingParams]]:
    """``batch`` requests; sampled ones alternate greedy proposals (one-hot rejection) and sampled proposals
    (standard rejection), so a batch mixes both rules and their groups."""
    out = []
    for index in range(batch):
        params = SamplingParams(max_new_tokens=24, stop_token_ids=(), seed=index,
                                temperature=0.8 if sampled else 0.0,
                                proposal="sampled" if sampled and index % 2 == 0 else "greedy")
        out.append((PROMPTS[index % len(PROMPTS)], params))
    return out


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["static", "auto"])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_a_step_reads_the_device_once_at_every_batch_size(sessions, monkeypatch, batch, mode, sampled):
    session = sessions[mode]
    reads = HostReads(monkeypatch, session)
    handles = [session.submit(prompt, params) for prompt, params in requests(batch, sampled)]
    results = [handle.result() for handle in handles]
    monkeypatch.undo()
    assert all(len(result.token_ids) == 24 for result in results)
    assert reads.per_step, "no step ran"
    assert all(count == 1 for count in reads.per_step), [w for w in reads.what if len(w) != 1][:3]
    assert reads.what[0] == ["tolist"]  # the verdicts' transfer
    if mode == "static":  # every cycle drafted, with the embedded drafter's block of 16
        assert max(max(r.stats.draft_lens_used) for r in results) == 15


def test_static_speculation_times_nothing_and_feeds_no_cost_model(monkeypatch):
    """Measurement sits beside the step: with no subscriber, a static session never reads the clock in a step and
    its cost model stays empty; ``measure_costs`` subscribes it, and then every step feeds it."""
    with Session.from_checkpoints(max_batch=4) as session:
        scheduler = session._scheduler
        reads = []
        monkeypatch.setattr(scheduler, "clock", lambda: reads.append(1) or 0.0)
        session.generate(PROMPTS[0], SamplingParams(max_new_tokens=20, stop_token_ids=()))
        assert reads == [] and not scheduler.subscribers
        assert not any(session.costs.mark().values())  # nothing measured
        session.measure_costs()
        result = session.generate(PROMPTS[0], SamplingParams(max_new_tokens=20, stop_token_ids=()))
    assert reads  # closed: every step's subscribers have run
    assert sum(session.costs.mark().values()) >= 2 * len(result.stats.acceptance_lengths)


def test_auto_speculation_feeds_the_cost_model_and_the_planner_from_the_report():
    with Session.from_checkpoints(max_batch=2, speculation=SpeculationConfig(mode="auto")) as session:
        before = sum(session.costs.mark().values())
        rows: list[int] = []
        session._scheduler.subscribe(lambda report: rows.append(len(report.rows)))
        results = [h.result() for h in [session.submit(p, SamplingParams(max_new_tokens=24, stop_token_ids=()))
                                        for p in PROMPTS[:2]]]
    # closed: the worker has run the subscribers of its last step too (they run after the cycles are handed over)
    assert sum(session.costs.mark().values()) > before
    assert session._scheduler.prior.drafted == sum(r.stats.num_draft_tokens for r in results)
    assert session._scheduler.prior.steps_served == sum(rows) > 0  # a request-step per row of each step, drafted or not


def test_a_requests_first_draft_takes_in_its_prompt_and_the_report_says_so():
    """The cost model keeps no overhead of a step where a row took in its prompt's context taps (a one-off): the
    step's report tells it apart from the steady-state steps that follow."""
    with Session.from_checkpoints() as session:
        reports = []
        session._scheduler.subscribe(reports.append)
        prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her"
        assert len(session.encode(prompt)) > session.default_block_len  # more context than a block
        session.generate(prompt, SamplingParams(max_new_tokens=40, stop_token_ids=()))
    drafting = [r for r in reports if r.draft_rows]
    assert drafting[0].took_in_context and drafting[0].draft_width > drafting[0].verify_width
    steady = [r for r in drafting[1:] if r.verify_width == session.default_block_len]  # full blocks
    assert len(steady) >= 2 and not any(r.took_in_context for r in steady)


def test_a_sampled_request_on_non_finite_logits_fails_alone_with_the_reason():
    """Target logits of NaN: the sampled request cannot draw and fails with NumericalError at its first token
    (flagged on the device, read in the prefill's one transfer); a greedy request of the same batch runs on."""
    from dflash_trt.errors import NumericalError
    from dflash_trt.formats.load import load_pair

    pair = load_pair(use_draft=False)
    with torch.no_grad():
        pair.target.norm.weight.fill_(float("nan"))
    with Session(pair, max_batch=2) as session:
        sampled = session.submit(PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=1.0, seed=3))
        greedy = session.submit(PROMPTS[1], SamplingParams(max_new_tokens=4, stop_token_ids=()))
        with pytest.raises(NumericalError, match="not finite.*Fix:"):
            sampled.result()
        assert sampled.finish_reason == "error"
        assert len(greedy.result().token_ids) == 4
