"""``--max-seq-len`` on every command that builds a session (run, serve, bench, triton export): validated at the
boundary, carried to the Session, and the KV cache it sizes printed at start-up (dflash_trt/cli.py,
serving/, bench/command.py; docs/style.md R5, R7)."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from dflash_trt.bench.datasets import Prompt, PromptSet
from dflash_trt.bench.harness import BenchConfig, context_needed
from dflash_trt.cli import main
from dflash_trt.errors import RequestError

KV_LINE = re.compile(r"KV cache: target [\d.]+ [KMG]iB \+ drafter [\d.]+ [KMG]iB "
                     r"\(max_batch (\d+) x max_seq_len (\d+), dtype (\w+)\)")


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def test_run_prints_the_kv_cache_it_allocated_for_the_given_context():
    result = invoke("run", "--prompt", "Once upon a time", "--max-new-tokens", "4", "--max-seq-len", "64")
    assert result.exit_code == 0, result.output
    assert KV_LINE.search(result.output).groups() == ("1", "64", "float32")


@pytest.mark.parametrize("value, found", [("0", "max_seq_len is 0; expected a positive integer"),
                                          ("-3", "max_seq_len is -3; expected a positive integer"),
                                          ("100000", "max_seq_len is 100000; expected <= 512")])
def test_run_refuses_a_context_that_is_not_positive_or_beyond_the_model_positions(value, found):
    result = invoke("run", "--prompt", "Once", "--max-seq-len", value)
    assert isinstance(result.exception, RequestError)
    assert found in str(result.exception) and "Fix:" in str(result.exception)


def test_a_request_longer_than_the_context_is_refused_with_the_room_left():
    result = invoke("run", "--prompt-ids", "1,403,407", "--max-new-tokens", "30", "--max-seq-len", "16")
    assert isinstance(result.exception, RequestError)
    assert "prompt (3 tokens) + max_new_tokens (30) = 33; expected <= the context length 16" in str(result.exception)
    assert "max_new_tokens <= 13" in str(result.exception)


def test_serve_refuses_a_zero_context_before_binding_or_loading():
    result = invoke("serve", "--max-seq-len", "0", "--port", "0")
    assert isinstance(result.exception, RequestError) and "max_seq_len" in str(result.exception)


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_an_explicit_dtype_with_an_engine_is_refused_not_ignored(command, tmp_path):
    extra = ("--out", str(tmp_path / "report")) if command == "bench" else ()
    result = invoke(command, "--engine", str(tmp_path), "--dtype", "bfloat16", *extra)
    assert isinstance(result.exception, RequestError)
    assert "--dtype is bfloat16 with --engine" in str(result.exception) and "Fix:" in str(result.exception)


def test_an_engine_without_dtype_is_accepted():
    pytest.importorskip("fastapi")
    from dflash_trt.serving.openai.server import ServeConfig

    assert ServeConfig(engine="engines/x").dtype is None  # the default must not count as an explicit --dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_serve_builds_its_session_with_the_context_and_dtype_and_announces_the_kv_cache(dtype):
    pytest.importorskip("fastapi")
    from dflash_trt.serving.openai.server import ServeConfig, build_app

    lines: list[str] = []
    app, model = build_app(ServeConfig(max_batch=2, max_seq_len=96, dtype=dtype), lines.append)
    assert KV_LINE.search(lines[0]).groups() == ("2", "96", dtype)


def test_triton_export_carries_the_context_to_the_model_and_a_hand_edited_one_is_refused(tmp_path):
    pytest.importorskip("tritonclient")
    from dflash_trt.serving import triton_io as io
    from dflash_trt.serving.triton_repo import check_model_config
    from dflash_trt.errors import ServingError

    result = invoke("triton", "export", "--repo", str(tmp_path), "--max-seq-len", "128")
    assert result.exit_code == 0, result.output
    path = tmp_path / "dflash" / "config.pbtxt"
    cfg = check_model_config(path)
    parameters = {k: {"string_value": v.string_value} for k, v in cfg.parameters.items()}
    settings = io.ModelSettings.from_model_config({"name": cfg.name, "parameters": parameters})
    assert settings.max_seq_len == 128
    lines: list[str] = []
    session = io.open_session(settings, announce=lines.append)
    assert session.max_seq_len == 128 and KV_LINE.search(lines[0]).groups()[1] == "128"
    session.close()
    path.write_text(path.read_text().replace('string_value: "128"', 'string_value: "lots"'))
    with pytest.raises(ServingError, match="`max_seq_len` is 'lots', expected a positive integer"):
        check_model_config(path)
    with pytest.raises(RequestError, match="`max_seq_len` is 'lots'; expected a positive integer"):
        io.ModelSettings.from_model_config({"name": "dflash", "parameters": parameters | {
            io.PARAM_MAX_SEQ_LEN: {"string_value": "lots"}}})


def test_bench_sizes_its_context_by_the_longest_request_it_will_run():
    def prompt_set(name: str, lengths: tuple[int, ...]) -> PromptSet:
        return PromptSet(name, tuple(Prompt(str(n), name, "c", "x" * n) for n in lengths), "", "test")

    sets = [prompt_set("a", (5, 40, 9)), prompt_set("b", (70, 3))]
    config = BenchConfig(num_prompts=2, max_new_tokens=10, warmup=1)
    encode = lambda text: list(range(len(text)))  # noqa: E731  one token per character
    assert context_needed(sets, encode, config, limit=512) == 70 + 10
    assert context_needed(sets, encode, config, limit=60) == 40 + 10  # "b"'s 70 does not fit: skipped, not cut
    assert context_needed(sets, encode, config.model_copy(update={"num_prompts": 1}), limit=512) == 70 + 10


def test_bench_prints_both_sessions_kv_caches_at_the_context_its_requests_need(tmp_path):
    result = invoke("bench", "--datasets", "tinystories", "--num-prompts", "1", "--concurrency", "1",
                    "--max-new-tokens", "4", "--no-peers", "--dtype", "bfloat16", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    lines = KV_LINE.findall(result.output)
    assert len(lines) == 2 and lines[0] == lines[1]  # the static and the adaptive session
    assert 4 < int(lines[0][1]) < 512  # the longest prompt + 4, not the model's 512 positions
    assert lines[0][2] == "bfloat16"


@pytest.mark.parametrize("extra, named", [(("--engine", "{tmp}"), "--engine"), ((), "the peers")])
def test_bench_refuses_a_device_it_would_not_use(extra, named, tmp_path):
    """Off the CPU, ``bench`` runs checkpoints on the torch backend only, and the transformers peer runs on the CPU:
    a ``--device`` it would not honour is refused before anything loads, naming what conflicts."""
    args = [a.format(tmp=tmp_path) for a in extra]
    result = invoke("bench", "--device", "cuda", *args, "--out", str(tmp_path / "report"))
    assert isinstance(result.exception, RequestError)
    message = str(result.exception)
    assert f"--device is cuda with {named}" in message and "Fix:" in message
