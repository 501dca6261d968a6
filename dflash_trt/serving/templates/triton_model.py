"""Triton python-backend model for dflash_trt, written by `dflash-trt triton export` (re-export, do not edit).
Thin (style.md R14): tensors in dflash_trt.serving.triton_io, metrics in .metrics, the algorithm in dflash_trt.runtime.
Each request gets its own response (or stream ending in COMPLETE_FINAL); a bad one never takes the model down."""

import json

import triton_python_backend_utils as pb_utils

from dflash_trt.serving import triton_io as io
from dflash_trt.serving.metrics import TritonSpecMetrics

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        s = self.settings = io.ModelSettings.from_model_config(json.loads(args["model_config"]))
        if s.policy_problem():
            raise pb_utils.TritonModelException(s.policy_problem())
        self.session = io.open_session(s)  # torch loads here, not when Triton only reads the config
        self.parser = io.RequestParser(self.session)
        self.metrics = TritonSpecMetrics(pb_utils, {"model": s.name, "version": args["model_version"]})

    def execute(self, requests):
        jobs = [self._guarded(self._start, request) for request in requests]  # all submitted first: one batch
        if not self.settings.decoupled:
            return [job if isinstance(job, pb_utils.InferenceResponse) else self._guarded(self._finish, request, job)
                    for request, job in zip(requests, jobs)]
        streams = []
        for request, job in zip(requests, jobs):
            sender = request.get_response_sender()
            if isinstance(job, pb_utils.InferenceResponse) or not job[1]:  # an error, or one whole response
                sender.send(job if isinstance(job, pb_utils.InferenceResponse)
                            else self._guarded(self._finish, request, job), flags=FINAL)
            else:
                streams.append((request, sender, job[0]))
        for index, item in io.interleave([handle for _, _, handle in streams]):  # sent from this thread only
            request, sender, handle = streams[index]
            if isinstance(item, Exception):
                self.metrics.failed(item)
                sender.send(io.error_response(pb_utils, item), flags=FINAL)
            elif item.finish_reason == "cancelled":
                self.metrics.observe(handle.stats, item.finish_reason)
                sender.send(io.error_response(pb_utils, "cancelled"), flags=FINAL)
            elif request.is_cancelled() and not item.finished:
                handle.cancel()  # its next chunk is the final, cancelled one
            else:  # (a stream cancelled as it ended gets its end: every stream is closed with FINAL)
                outputs = io.chunk_outputs(item, handle.stats, self.settings.batched)
                if item.finished:  # counted before its end is sent: a client that saw the end sees its counters
                    self.metrics.observe(handle.stats, item.finish_reason)
                sender.send(io.response(pb_utils, outputs), flags=FINAL if item.finished else 0)
        return None

    def _start(self, request):
        job = self.parser.parse(io.reader(pb_utils, request))
        if job.stream and not self.settings.decoupled:
            raise io.RequestError(f"`stream` is true but model {self.settings.name!r} is not decoupled. Fix: send "
                                  "stream=false, or use a model exported with `dflash-trt triton export --streaming`.")
        return self.session.submit(job.prompt, job.params), job.stream  # thread-safe; requests share forwards

    def _finish(self, request, job):
        result = io.result_unless_cancelled(job[0], request)  # a client that left frees the request's slot
        self.metrics.observe(result.stats, result.finish_reason)
        if result.finish_reason == "cancelled":
            return io.error_response(pb_utils, "cancelled")
        return io.response(pb_utils, io.result_outputs(result, self.settings.batched))

    def _guarded(self, work, *arguments):
        try:
            return work(*arguments)
        except Exception as exc:  # this request's response carries the error; the model keeps serving
            self.metrics.failed(exc)  # Triton counts an answered request as a success, error or not
            return io.error_response(pb_utils, exc)

    def finalize(self):
        self.session.close(cancel=True)
        self.metrics.close()
