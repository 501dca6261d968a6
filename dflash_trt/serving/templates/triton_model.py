"""Triton python-backend model for dflash_trt, written by `dflash-trt triton export` (do not edit; re-export).

Thin on purpose (style R14): request parsing and response tensors live in dflash_trt.serving.triton_io, metrics
in dflash_trt.serving.metrics, the algorithm in dflash_trt.runtime. Every request gets its own response (or its
own stream ending in TRITONSERVER_RESPONSE_COMPLETE_FINAL); a bad request never takes the model down.
"""

import json

import triton_python_backend_utils as pb_utils

from dflash_trt.serving import triton_io as io
from dflash_trt.serving.metrics import TritonSpecMetrics

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        from dflash_trt.runtime.session import Session  # torch loads here, not when Triton only reads the config

        s = self.settings = io.ModelSettings.from_model_config(json.loads(args["model_config"]))
        if s.policy_problem():
            raise pb_utils.TritonModelException(s.policy_problem())
        self.session = Session.load(s.engine_dir, s.backend) if s.engine_dir else Session.from_checkpoints(
            s.target, s.draft)
        self.parser = io.RequestParser(self.session)
        self.submit = lambda prompt, params: io.DeferredGeneration(self.session, prompt, params)
        self.metrics = TritonSpecMetrics(pb_utils, {"model": s.name, "version": args["model_version"]})

    def execute(self, requests):
        if self.settings.decoupled:
            for request in requests:
                self._stream(request)
            return None
        handles = [_guarded(self._start, request) for request in requests]  # all submitted, then collected
        return [h if isinstance(h, pb_utils.InferenceResponse) else _guarded(self._finish, h) for h in handles]

    def _start(self, request, decoupled=False):
        job = self.parser.parse(io.reader(pb_utils, request))
        if job.stream and not decoupled:
            raise io.RequestError(f"`stream` is true but model {self.settings.name!r} is not decoupled. Fix: send "
                                  "stream=false, or use a model exported with `dflash-trt triton export --streaming`.")
        return self.submit(job.prompt, job.params), job.stream

    def _finish(self, started):
        result = started[0].result()
        self.metrics.observe(result.stats)
        return io.response(pb_utils, io.result_outputs(result, self.settings.batched))

    def _stream(self, request):
        sender = request.get_response_sender()
        try:
            handle, stream = self._start(request, decoupled=True)
            if not stream:
                return sender.send(self._finish((handle, stream)), flags=FINAL)
            for chunk in handle:
                if request.is_cancelled():
                    return sender.send(io.error_response(pb_utils, "request cancelled by the client"), flags=FINAL)
                outputs = io.chunk_outputs(chunk, handle.stats, self.settings.batched)
                sender.send(io.response(pb_utils, outputs), flags=FINAL if chunk.finished else 0)
                if chunk.finished:
                    return self.metrics.observe(handle.stats)
            sender.send(flags=FINAL)
        except Exception as exc:  # this request's stream carries the error; the model keeps serving
            sender.send(io.error_response(pb_utils, exc), flags=FINAL)

    def finalize(self):
        self.metrics.close()


def _guarded(work, argument):
    try:
        return work(argument)
    except Exception as exc:  # this request's response carries the error; the model keeps serving
        return io.error_response(pb_utils, exc)
