"""``Session`` lifecycle (dflash_trt/runtime/session.py, runtime/scheduler.py): closing, context manager, a dropped
session's worker, leaving ``stream()`` early, and one failing request isolated from the rest of its batch.

The process-level checks run in a fresh interpreter (a subprocess), since exit codes, threads and RSS are
properties of a whole process. All of it runs on the embedded stories260K pair.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from dflash_trt.formats.load import load_pair
from dflash_trt.config import SamplingParams
from dflash_trt.errors import RequestError
from dflash_trt.runtime.session import Session

PROMPTS = ["Once upon a time", "One day, a little boy named Tim", "Lily and Ben were", "The sun was"]

LOOP_SCRIPT = textwrap.dedent("""
    import gc, json, sys, threading
    from dflash_trt.config import SamplingParams
    from dflash_trt.runtime.session import Session

    def rss_mib():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

    close = sys.argv[1] == "close"
    rss = []
    for index in range(20):
        if close:
            with Session.from_checkpoints(max_batch=2) as session:
                session.generate("Once upon a time", SamplingParams(max_new_tokens=16))
        else:  # dropped without close(): its worker must still end and its memory come back
            session = Session.from_checkpoints(max_batch=2)
            session.generate("Once upon a time", SamplingParams(max_new_tokens=16))
            del session
        gc.collect()
        rss.append(rss_mib())
    # a dropped session may be collected on its own worker thread, which then ends by itself a moment later:
    # give every worker time to end (one that never does is still counted)
    for thread in threading.enumerate():
        if thread is not threading.main_thread():
            thread.join(timeout=10)
    print(json.dumps({"rss": rss, "threads": threading.active_count(), "frozen": gc.get_freeze_count()}))
""")


def run_loop(mode: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", LOOP_SCRIPT, mode], capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # 134 was `terminate called ...`
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["close", "drop"])
def test_twenty_sessions_in_one_process_exit_0_with_flat_rss_and_no_leftover_thread(mode):
    report = run_loop(mode)
    # after the first sessions (allocator and import warm-up), RSS stays within 10 %
    assert report["rss"][-1] <= 1.10 * report["rss"][2], report["rss"]
    assert report["threads"] == 1, report  # only the main thread: every session's worker has ended
    assert report["frozen"] == 0, report  # a Session no longer gc.freeze()s the whole process


def test_with_block_closes_the_session_and_a_closed_session_refuses_requests():
    with Session.from_checkpoints() as session:
        assert session.generate(PROMPTS[0], SamplingParams(max_new_tokens=4)).finish_reason == "length"
    with pytest.raises(Exception, match="closed"):
        session.submit(PROMPTS[0], SamplingParams(max_new_tokens=4))
    session.close()  # idempotent


def test_on_end_is_called_once_from_the_worker_when_a_request_ends_finished_or_cancelled():
    import threading

    calls: list[tuple[str, bool]] = []
    with Session.from_checkpoints(max_batch=2) as session:
        def on_end(name):
            return lambda: calls.append((name, threading.current_thread() is not threading.main_thread()))

        finished = session.submit(PROMPTS[0], SamplingParams(max_new_tokens=6, block_len=4), on_end=on_end("done"))
        result = finished.result()
        assert calls == [("done", True)] and result.finish_reason == "length"  # called before result() returned
        cancelled = session.submit(PROMPTS[1], SamplingParams(max_new_tokens=500), on_end=on_end("cancelled"))
        next(iter(cancelled))
        cancelled.cancel()
        assert cancelled.result().finish_reason == "cancelled"
    assert calls == [("done", True), ("cancelled", True)]


def test_num_unfinished_requests_counts_what_is_queued_or_decoding_until_it_ends():
    session = Session.from_checkpoints(max_batch=1)
    gate, target_batch = threading.Event(), session.backend.target_batch

    def held(rows, with_taps):  # the real forward, once the test opens the gate
        gate.wait(60)
        return target_batch(rows, with_taps)

    session.backend.target_batch = held
    with session:
        assert session.num_unfinished_requests() == 0
        params = SamplingParams(max_new_tokens=200, stop_token_ids=[])
        first, second = session.submit(PROMPTS[0], params), session.submit(PROMPTS[1], params)  # one decodes, one waits
        assert session.num_unfinished_requests() == 2
        first.cancel()
        second.cancel()
        gate.set()
        assert {first.result().finish_reason, second.result().finish_reason} <= {"cancelled", "length"}
        assert first.ended() and second.ended() and session.num_unfinished_requests() == 0
        with pytest.raises(RequestError):
            session.submit(PROMPTS[0], SamplingParams(max_new_tokens=10_000))  # refused: never counted
        assert session.num_unfinished_requests() == 0
        session.generate(PROMPTS[2], SamplingParams(max_new_tokens=4))
        assert session.num_unfinished_requests() == 0
    with pytest.raises(RequestError):
        session.submit(PROMPTS[0], SamplingParams(max_new_tokens=4))  # closed
    assert session.num_unfinished_requests() == 0


def test_leaving_stream_early_cancels_the_request():
    session = Session.from_checkpoints(use_draft=False, max_batch=1)
    forwards = []
    target_batch = session.backend.target_batch

    def counted(rows, with_taps):  # counts the real backend's verify forwards; the computation is unchanged
        forwards.append(len(rows))
        return target_batch(rows, with_taps)

    session.backend.target_batch = counted
    with session:
        for index, _chunk in enumerate(session.stream(PROMPTS[0], SamplingParams(max_new_tokens=200))):
            if index == 2:
                break
        # one slot: this request waits until the abandoned one has left it
        after = session.generate(PROMPTS[1], SamplingParams(max_new_tokens=4))
    assert after.finish_reason == "length" and len(after.token_ids) == 4
    # plain decoding makes one token per forward: 200 forwards if the abandoned request had run to its end
    assert len(forwards) < 100, len(forwards)


def test_one_failing_request_fails_alone_and_the_rest_of_its_batch_finishes_correctly():
    """A drafter whose weights hold NaN: a ``proposal="sampled"`` request cannot draw from its NaN proposal
    distribution and fails; greedy requests sharing its batches are lossless whatever the drafter proposes."""
    pair = load_pair()
    with torch.no_grad():
        pair.draft.norm.weight.fill_(float("nan"))  # every draft logit becomes NaN
    expected = {}
    with Session.from_checkpoints(use_draft=False) as plain:
        for prompt in PROMPTS:
            expected[prompt] = plain.generate(prompt, SamplingParams(max_new_tokens=32)).token_ids
    with Session(pair, max_batch=8, speculation=None) as session:
        handles = [session.submit(prompt, SamplingParams(max_new_tokens=32)) for prompt in PROMPTS[:2]]
        bad = session.submit(PROMPTS[0], SamplingParams(max_new_tokens=32, temperature=0.8, seed=1,
                                                        proposal="sampled"))
        handles += [session.submit(prompt, SamplingParams(max_new_tokens=32)) for prompt in PROMPTS[2:]]
        with pytest.raises(RuntimeError):
            bad.result()
        assert bad.finish_reason == "error"
        for prompt, handle in zip(PROMPTS, handles):
            result = handle.result()
            assert result.finish_reason == "length" and result.token_ids == expected[prompt], prompt
        # the session keeps serving after the failure
        assert session.generate(PROMPTS[3], SamplingParams(max_new_tokens=8)).token_ids == expected[PROMPTS[3]][:8]
