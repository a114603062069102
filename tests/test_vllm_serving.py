"""Serving on the card with vLLM: the offline LLM and the OpenAI-compatible server give
Hugging Face CPU generate()'s greedy tokens for tiny random-weight models."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import tiny_hf  # noqa: E402

HERE = Path(__file__).parent
PROMPTS = [[1, 5, 9, 33, 70], list(range(4, 4 + 70)), [1, 200, 100], [7] * 20]
NEW_TOKENS = 6
# Hugging Face's reference (tiny_hf.hf_greedy) makes every token with min_new_tokens, which
# keeps the end-of-sequence token from being chosen; vLLM's min_tokens does the same
HF_GREEDY = {"ignore_eos": True, "min_tokens": NEW_TOKENS}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SPYRE_RT_VLLM", None)   # the plugin must be chosen by itself
    env.pop("VLLM_TARGET_DEVICE", None)
    return env


# Granite's tokens are checked through the server (which serves a tiny Granite) and Qwen3's
# path is Llama's with a norm on queries and keys: their own engine starts are slow tests.
@pytest.mark.parametrize("family", ["llama", pytest.param("granite", marks=pytest.mark.slow),
                                    pytest.param("qwen3", marks=pytest.mark.slow), "qwen3_moe"])
def test_llm_generate_matches_hugging_face(family, tmp_path):
    model = tiny_hf.save_model(family, tmp_path / family)
    expected = [tiny_hf.hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    faults = family == "llama"
    run = subprocess.run(
        [sys.executable, str(HERE / "vllm_generate.py"), str(tmp_path / family), json.dumps(PROMPTS),
         str(NEW_TOKENS), *(["faults"] if faults else [])],
        capture_output=True, text=True, timeout=600, env=_env(),
    )
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, run.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["platform"] == "SpyrePlatform"
    assert got["alone"] == expected[:1]
    assert got["together"] == expected
    # every decode step was replayed from torch.spyre.graph captures made at start-up, one per
    # bucket (max_num_seqs=4: 2, 4); steps that also prefill replay their decodes too
    [decode] = got["decode"]
    assert decode["captures"] == 2
    assert decode["replays"] >= 2 * (NEW_TOKENS - 1)
    assert decode["compiled"] == 0
    if faults:
        # a card fault in a prefill step and one in a decode step (a replay) end the requests of
        # that step with vLLM's error finish reason; the engine serves the next request
        ended = got["faults"]["ended"]
        assert ended == {"prefill-0": ["error", 0], "prefill-1": ["error", 0],
                         "decode-0": ["error", 1], "decode-1": ["error", 1],
                         "late-0": ["error", 2], "late-1": ["error", 2]}, run.stderr[-3000:]
        assert got["faults"]["after"] == expected[0]


def test_the_first_context_bucket_is_a_setting_checked_at_start_up(monkeypatch, capsys):
    from spyre_rt.profiler import cli
    from spyre_rt.serving.bucketing import MIN_CONTEXT_TOKENS
    from spyre_rt.serving.platform import SpyrePlatform, min_context_tokens

    monkeypatch.delenv("SPYRE_RT_VLLM_MIN_CONTEXT", raising=False)
    assert min_context_tokens() == MIN_CONTEXT_TOKENS == 1024
    for raw, tokens in (("0", 0), (" 256 ", 256)):
        monkeypatch.setenv("SPYRE_RT_VLLM_MIN_CONTEXT", raw)
        assert min_context_tokens() == tokens
    for raw in ("-64", "lots", "1.5"):
        monkeypatch.setenv("SPYRE_RT_VLLM_MIN_CONTEXT", raw)
        with pytest.raises(ValueError, match=r"SPYRE_RT_VLLM_MIN_CONTEXT must be a number of tokens .*" + raw):
            min_context_tokens()
        # vLLM's engine refuses it with its configuration, before a worker starts
        with pytest.raises(ValueError, match="SPYRE_RT_VLLM_MIN_CONTEXT must be a number of tokens"):
            SpyrePlatform.check_and_update_config(_checked_config(block_size=64))
        # the profiler refuses it before it imports vLLM
        assert cli.main(["serve", "granite-tiny", "--input", "8", "--output", "4"]) == 1
        assert f"SPYRE_RT_VLLM_MIN_CONTEXT must be a number of tokens (0 or more), not '{raw}'" \
            in capsys.readouterr().err
    monkeypatch.delenv("SPYRE_RT_VLLM_MIN_CONTEXT")
    # the profiler's longest length must hold a request
    assert cli.main(["serve", "granite-tiny", "--input", "64", "--output", "16", "--max-model-len", "64"]) == 1
    assert "--max-model-len 64 is shorter than a request: --input 64 plus --output 16" in capsys.readouterr().err


def test_decodes_read_the_context_bucket_of_their_longest_request(tmp_path):
    """A longest length of 512 tokens in context buckets of 128, 256 and 512
    (``SPYRE_RT_VLLM_MIN_CONTEXT=128``): a decode replays the capture of its batch size and
    of its longest request's context, and a request that grows past a bucket moves to the
    next, with Hugging Face's tokens throughout."""
    model = tiny_hf.save_model("llama", tmp_path / "llama")
    prompts = [list(range(4, 4 + 100)), [1, 5, 9]]
    new = 40   # the long request: 100 to 140 tokens, from the first bucket into the second
    expected = [tiny_hf.hf_greedy(model, p, new) for p in prompts]
    run = subprocess.run(
        [sys.executable, str(HERE / "vllm_generate.py"), str(tmp_path / "llama"), json.dumps(prompts), str(new),
         "max_model_len=512"],
        capture_output=True, text=True, timeout=600, env={**_env(), "SPYRE_RT_VLLM_MIN_CONTEXT": "128"},
    )
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, run.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["alone"] == expected[:1] and got["together"] == expected
    [decode] = got["decode"]
    assert decode["captures"] == 2 * 3                  # batch sizes 2 and 4, each with 3 contexts
    assert decode["compiled"] == 0
    # alone, then together (one grid): a decode step of the long request at n tokens (101 to
    # 139, its new one counted) needs ceil(n / 64) blocks: 2 up to 128 tokens, then 3, in 4
    lens = range(len(prompts[0]) + 1, len(prompts[0]) + new)
    assert decode["contexts"] == {"2": 2 * sum(n <= 128 for n in lens), "4": 2 * sum(n > 128 for n in lens)}, decode


FP16_LOGPROB_TOLERANCE = 0.01   # nats, on the prompts' logprobs of a tiny random-weight model (measured: 0.0003)


def test_fp16_logprobs_agree_with_fp32(tmp_path):
    """fp16 on the card (fp16 storage, fp32 accumulation) against Hugging Face fp32 on the CPU,
    on each prompt token's logprob given those before it (no sampled token involved)."""
    model = tiny_hf.save_model("llama", tmp_path / "llama")
    run = subprocess.run(
        [sys.executable, str(HERE / "vllm_generate.py"), str(tmp_path / "llama"), json.dumps(PROMPTS), "1",
         "float16"],
        capture_output=True, text=True, timeout=600, env=_env(),
    )
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, run.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])["prompt_logprobs"]
    worst = 0.0
    for p, lps in zip(PROMPTS, got, strict=True):
        ref = _hf_logprobs(model, p[:1], p[1:])
        worst = max(worst, *(abs(a - b) for a, b in zip(lps, ref, strict=True)))
    print(f"fp16 against fp32: worst prompt logprob difference {worst:.4f}")
    assert worst < FP16_LOGPROB_TOLERANCE


def _checked_config(block_size: int):
    """What the platform's configuration check reads before it hands over to the CPU
    platform's: a block size the user chose, and no model."""
    from vllm.config import CacheConfig

    class Config:
        cache_config = CacheConfig(block_size=block_size)
        model_config = None

    Config.cache_config.user_specified_block_size = True
    return Config


def test_block_size_must_be_whole_sticks():
    from spyre_rt.serving.platform import SpyrePlatform

    with pytest.raises(ValueError, match="multiple of 64"):
        SpyrePlatform.check_and_update_config(_checked_config(block_size=48))


def test_kv_cache_budget_is_the_cards_share():
    from spyre_rt.serving.worker import kv_cache_budget

    assert kv_cache_budget(1000, 100, 0.5) == 400
    assert kv_cache_budget(1000, 100, 0.5, most_used=250) == 250
    with pytest.raises(ValueError, match="no room for a KV cache"):
        kv_cache_budget(1000, 600, 0.5)
    with pytest.raises(ValueError, match=r"has 400 bytes .* max_model_len=256 tokens needs 500 bytes"):
        kv_cache_budget(1000, 100, 0.5, one_request=500, max_model_len=256)


@pytest.mark.slow   # an engine start; the check itself is test_kv_cache_budget_is_the_cards_share's
def test_a_kv_cache_too_small_for_one_request_stops_the_start_up_naming_the_sizes(tmp_path):
    tiny_hf.save_model("llama", tmp_path / "m")
    code = (f"from vllm import LLM; LLM(model={str(tmp_path / 'm')!r}, dtype='float32', max_model_len=256, "
            "max_num_seqs=2, kv_cache_memory_bytes=4096)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert run.returncode != 0
    # 2 layers x (key + value) x 2 KV heads x 16 x fp32, for 256 tokens
    assert "the KV cache has 4096 bytes (kv_cache_memory_bytes), but one request of max_model_len=256 " \
           f"tokens needs {2 * 2 * 2 * 16 * 4 * 256} bytes" in run.stderr, run.stderr[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(model_dir: Path, *args: str, env: dict[str, str] | None = None):
    """`vllm serve MODEL_DIR ARGS` on 127.0.0.1 and a free port, with vLLM's development
    endpoints (``/collective_rpc``: the tests inject card faults through it), until ready;
    stopped (its process group) at the end."""
    port = _free_port()
    log_path = model_dir.parent / f"server-{model_dir.name}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir), "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", "--max-model-len", "256", "--gpu-memory-utilization", "0.002",
         "--max-num-seqs", "4", "--max-num-batched-tokens", "128", *args],
        stdout=log, stderr=subprocess.STDOUT, env={**_env(), "VLLM_SERVER_DEV_MODE": "1", **(env or {})},
        start_new_session=True,
    )
    import urllib.request

    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("vllm serve exited: " + log_path.read_text()[-4000:])
            if time.monotonic() - start > 900:
                raise TimeoutError("vllm serve was not ready in 900 s")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        yield {"url": url, "model": str(model_dir), "ready_s": time.monotonic() - start}
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`vllm serve` on a tiny Granite (see :func:`serving`)."""
    d = tmp_path_factory.mktemp("serve") / "tiny-granite"
    model = tiny_hf.save_model("granite", d)
    with serving(d) as s:
        yield {**s, "hf": model}


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="none", timeout=120, max_retries=0)


def _words(ids: list[int]) -> str:
    return " ".join(tiny_hf.word(i) for i in ids)


def test_completion_gives_hugging_face_tokens(server, client):
    prompt = [9, 33, 70, 120]
    expected = tiny_hf.hf_greedy(server["hf"], prompt, NEW_TOKENS)
    out = client.completions.create(model=server["model"], prompt=_words(prompt), max_tokens=NEW_TOKENS,
                                    temperature=0.0, extra_body={**HF_GREEDY,
                                                                 "return_token_ids": True})
    assert out.choices[0].prompt_token_ids == prompt
    assert out.choices[0].token_ids == expected
    assert out.choices[0].text.strip() == _words(expected)
    assert out.usage.completion_tokens == NEW_TOKENS


def test_completion_streams(server, client):
    stream = client.completions.create(model=server["model"], prompt=_words([40, 41, 42]),
                                       max_tokens=NEW_TOKENS, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    pieces = [c.choices[0].text for c in stream if c.choices]
    whole = client.completions.create(model=server["model"], prompt=_words([40, 41, 42]),
                                      max_tokens=NEW_TOKENS, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert len(pieces) > 1
    assert "".join(pieces) == whole.choices[0].text


def test_chat_completion_and_its_stream(server, client):
    messages = [{"role": "user", "content": _words([50, 60, 70])}]
    out = client.chat.completions.create(model=server["model"], messages=messages, max_tokens=NEW_TOKENS,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    text = out.choices[0].message.content
    assert out.usage.completion_tokens == NEW_TOKENS
    stream = client.chat.completions.create(model=server["model"], messages=messages,
                                            max_tokens=NEW_TOKENS, temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text


def test_bad_request_is_400_and_the_server_keeps_serving(server, client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server["model"], prompt=_words([5, 6]), max_tokens=0)
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server["model"], prompt=_words([5, 6]), max_tokens=-3)
    out = client.completions.create(model=server["model"], prompt=_words([5, 6]), max_tokens=2)
    assert out.usage.completion_tokens >= 1


def _post(server, path: str, body: bytes):
    """A raw request to the server: (HTTP status, the JSON body)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server["url"] + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _still_serves(server, client):
    out = client.completions.create(model=server["model"], prompt=_words([5, 6]), max_tokens=2, temperature=0.0)
    assert out.usage.completion_tokens >= 1


def test_bad_prompts_and_bodies_are_rejected_and_the_server_keeps_serving(server, client):
    import openai

    for prompt in ("", []):   # an empty prompt, as text and as tokens
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=server["model"], prompt=prompt, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context|maximum|longer"):   # past max-model-len 256
        client.completions.create(model=server["model"], prompt=_words([9] * 300), max_tokens=2)
    with pytest.raises(openai.NotFoundError) as e:   # vLLM's answer to a model it does not serve
        client.completions.create(model="no-such-model", prompt=_words([5]), max_tokens=2)
    assert e.value.status_code == 404
    status, body = _post(server, "/v1/completions", b'{"model": "x", "prompt": ')
    assert status == 400 and "error" in body
    status, body = _post(server, "/v1/chat/completions", b"[1, 2")
    assert status == 400 and "error" in body
    _still_serves(server, client)


def _hf_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    lp = logits.log_softmax(-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def test_logprobs_are_hugging_faces(server, client):
    prompt = [11, 22, 33, 44, 55]
    expected = tiny_hf.hf_greedy(server["hf"], prompt, NEW_TOKENS)
    out = client.completions.create(model=server["model"], prompt=_words(prompt), max_tokens=NEW_TOKENS,
                                    temperature=0.0, logprobs=3,
                                    extra_body={**HF_GREEDY, "return_token_ids": True})
    choice = out.choices[0]
    assert choice.token_ids == expected
    assert len(choice.logprobs.top_logprobs) == NEW_TOKENS
    assert all(len(top) >= 3 for top in choice.logprobs.top_logprobs)
    # fp32 on the functional card against fp32 on the CPU
    for got, ref in zip(choice.logprobs.token_logprobs, _hf_logprobs(server["hf"], prompt, expected), strict=True):
        assert abs(got - ref) < 1e-3


def test_stop_strings_end_the_text(server, client):
    prompt = [60, 61, 62]
    expected = tiny_hf.hf_greedy(server["hf"], prompt, NEW_TOKENS)
    stop = tiny_hf.word(expected[3])
    if stop in {tiny_hf.word(t) for t in expected[:3]}:
        pytest.skip("the stop word comes earlier too")
    out = client.completions.create(model=server["model"], prompt=_words(prompt), max_tokens=NEW_TOKENS,
                                    temperature=0.0, stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text.strip() == _words(expected[:3])


def test_seeded_sampling_is_reproducible(server, client):
    def sample(seed):
        out = client.completions.create(model=server["model"], prompt=_words([70, 80, 90]), max_tokens=8,
                                        temperature=1.0, top_p=0.9, seed=seed,
                                        extra_body={"top_k": 50, "ignore_eos": True, "return_token_ids": True})
        return out.choices[0].token_ids

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))   # the seed is what fixes the draw


def test_concurrent_requests_of_different_lengths_give_hugging_faces_tokens(server, client):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[(7 * i + j) % 200 + 4 for j in range(3 + 5 * i)] for i in range(16)]   # 3 to 78 tokens
    expected = [tiny_hf.hf_greedy(server["hf"], p, NEW_TOKENS) for p in prompts]

    def complete(p):
        out = client.completions.create(model=server["model"], prompt=_words(p), max_tokens=NEW_TOKENS,
                                        temperature=0.0, extra_body={**HF_GREEDY, "return_token_ids": True})
        return out.choices[0].token_ids

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(complete, prompts))
    assert got == expected


def test_a_card_fault_fails_its_request_with_an_error_and_later_requests_are_served(server, client):
    import openai

    status, body = _post(server, "/collective_rpc",
                         json.dumps({"method": "inject_card_fault", "args": ["command", "3"]}).encode())
    assert status == 200, body
    with pytest.raises(openai.InternalServerError) as e:   # vLLM's GenerationError
        client.completions.create(model=server["model"], prompt=_words([21, 22, 23]), max_tokens=NEW_TOKENS,
                                  temperature=0.0, extra_body={"ignore_eos": True})
    assert e.value.status_code == 500
    prompt = [21, 22, 23]
    out = client.completions.create(model=server["model"], prompt=_words(prompt), max_tokens=NEW_TOKENS,
                                    temperature=0.0, extra_body={**HF_GREEDY, "return_token_ids": True})
    assert out.choices[0].token_ids == tiny_hf.hf_greedy(server["hf"], prompt, NEW_TOKENS)


def _metric(server, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(server["url"] + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_a_cancelled_stream_frees_its_kv_blocks(server, client):
    # The request asks for the longest answer max-model-len allows and the client hangs up
    # at its first token. Whether the request held blocks is read from what it did, not
    # from a gauge sampled while it ran (on a loaded host the client samples it too late:
    # the server runs ahead of a slow reader): it generated tokens, so it ran and held
    # blocks, and fewer than it asked for, so the disconnect cut it off. A loaded host can
    # also let the server finish before the client hangs up (240 tokens of the tiny model
    # take about a second); such an attempt shows nothing, and the next one is made.
    asked, attempts = 240, []
    while len(attempts) < 4:
        generated = _metric(server, "vllm:generation_tokens_total")
        stream = client.completions.create(model=server["model"], prompt=_words(list(range(10, 20))),
                                           max_tokens=asked, temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()   # the client disconnects mid-stream
        deadline = time.monotonic() + 60
        while _metric(server, "vllm:num_requests_running") or _metric(server, "vllm:kv_cache_usage_perc"):
            assert time.monotonic() < deadline, "the cancelled request kept its KV blocks"
            time.sleep(0.5)
        attempts.append(_metric(server, "vllm:generation_tokens_total") - generated)
        assert attempts[-1] >= 1, "the request generated nothing before the client hung up"
        if attempts[-1] < asked:
            break
    _still_serves(server, client)
    if attempts[-1] == asked:
        pytest.skip(f"the host was too slow to hang up before the server finished: {len(attempts)} requests "
                    "each ran to its end (and freed its blocks)")


def _paged_batch(seed: int = 0):
    """A step of three requests on a cache of 64-token blocks: 70 cached + 3 new tokens, a
    70-token prompt across two blocks, a 5-token prompt; and two padding tokens. Laid out
    as a grid of 4 requests by 80 tokens: the queries, keys and values of its cells (random
    in padding cells), its metadata, the flat token of each cell and the expected outputs."""
    import torch

    from spyre_rt.serving.attention import SpyreStepBatch
    from spyre_rt.serving.steps import layout

    g = torch.Generator().manual_seed(seed)
    heads, kvh, d, bs, n = 4, 2, 16, 64, 8
    cache = torch.zeros(2, kvh, n + 1, bs, d)
    table = torch.tensor([[3, 5], [1, 2], [0, 7]])
    lens, qlen = [73, 70, 5], [3, 70, 5]
    slot = lambda r, p: int(table[r, p // bs]) * bs + p % bs  # noqa: E731
    hist = {r: (torch.randn(lens[r], kvh, d, generator=g), torch.randn(lens[r], kvh, d, generator=g))
            for r in range(3)}
    for r in range(3):
        for p in range(lens[r] - qlen[r]):
            cache[0].view(kvh, -1, d)[:, slot(r, p)] = hist[r][0][p]
            cache[1].view(kvh, -1, d)[:, slot(r, p)] = hist[r][1][p]
    t = sum(qlen) + 2
    q = torch.randn(t, heads, d, generator=g)
    k = torch.cat([hist[r][0][lens[r] - qlen[r]:] for r in range(3)] + [torch.randn(2, kvh, d, generator=g)])
    v = torch.cat([hist[r][1][lens[r] - qlen[r]:] for r in range(3)] + [torch.randn(2, kvh, d, generator=g)])
    slots = [slot(r, p) for r in range(3) for p in range(lens[r] - qlen[r], lens[r])] + [-1, -1]
    qsl = torch.tensor([0, 3, 73, 78])
    batch = SpyreStepBatch(qsl, torch.tensor(lens), table, torch.tensor(slots), t, 3)
    grid = layout(batch, [0, 1, 2], 4, 80, block=bs, spare=n, blocks=2)
    keep = grid.source >= 0

    def cells(x):
        out = torch.randn(grid.source.shape[0], *x.shape[1:], generator=g)
        out[keep] = x[grid.source[keep]]
        return out

    expected = []
    for r in range(3):
        keys = hist[r][0].repeat_interleave(heads // kvh, 1)
        vals = hist[r][1].repeat_interleave(heads // kvh, 1)
        for i in range(qlen[r]):
            p = lens[r] - qlen[r] + i
            s = torch.einsum("hd,khd->hk", q[int(qsl[r]) + i], keys[: p + 1]) * 0.25
            expected.append(torch.einsum("hk,khd->hd", s.softmax(-1), vals[: p + 1]))
    return cells(q), cells(k), cells(v), cache, grid, torch.stack(expected)


def test_a_step_is_laid_out_as_a_grid_of_requests_padded_with_the_spare_block():
    q, k, v, cache, grid, expected = _paged_batch()
    assert (grid.rows, grid.width) == (4, 80)
    src = grid.source.view(4, 80)
    assert src[0, :4].tolist() == [0, 1, 2, -1] and src[1, :70].tolist() == list(range(3, 73))
    assert src[2, :6].tolist() == [73, 74, 75, 76, 77, -1] and (src[3] == -1).all()
    assert grid.meta.query_pos[0, :4].tolist() == [70, 71, 72, -1]
    assert grid.meta.block_table[3].tolist() == [8, 8]                   # a padding request: the spare block
    pad_slots = grid.meta.slot_mapping.view(4, 80)[3]
    assert ((pad_slots // 64) == 8).all()                                # padding writes only the spare block


def test_paged_attention_is_causal_per_request_with_gqa():
    from spyre_rt.serving.attention import paged_attention

    q, k, v, cache, grid, expected = _paged_batch()
    out = paged_attention(q, k, v, cache, grid.meta, 0.25)
    keep = grid.source >= 0
    assert (out[keep] - expected).abs().max() < 1e-5


def test_paged_attention_compiles_to_the_card_with_no_cpu_op():
    import torch

    import spyre_rt  # noqa: F401
    from spyre_rt.errors import forget_warnings
    from spyre_rt.executor import live_steps
    from spyre_rt.serving.attention import paged_attention

    q, k, v, cache, grid, expected = _paged_batch()
    card = torch.device("spyre")
    card_meta = grid.meta.to(card)
    card_cache = cache.to(card)
    fast = torch.compile(paged_attention, backend="spyre_rt", dynamic=True)
    earlier = set(live_steps())
    forget_warnings("aten.")   # an earlier test's warning must not hide a CPU op here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fast(q.to(card), k.to(card), v.to(card), card_cache, card_meta, 0.25).cpu()
    assert [str(w.message) for w in caught if "runs on the CPU" in str(w.message)] == []
    keep = grid.source >= 0
    assert (out[keep] - expected).abs().max() < 1e-5
    # the attention kernel reads the cache in place through the block table: no kernel
    # copies the requests' contexts out of it (a gather before the matmuls did, once)
    (exe,) = [e for st in set(live_steps()) - earlier for e in st.executables()]
    kernels = list(exe.desc.kernels.values())
    (attention,) = [k for k in kernels if k.kind == "attention"]
    assert attention.page == cache.shape[3] and attention.k[0] == attention.v[0]
    # the profiler's figures: the (query, key) pairs of each request's pages, and of the
    # cache only those pages (their keys and values), not the whole cache
    from spyre_rt.construct import facts

    reqs, blocks = grid.meta.block_table.shape
    _, kvh, _, bs, d = cache.shape
    heads, width = q.shape[1], grid.width
    assert facts.flops(attention) == 2 * reqs * heads * width * blocks * bs * 2 * d
    e = cache.element_size()
    pages = 2 * reqs * blocks * kvh * bs * d * e
    q_and_out = 2 * reqs * width * heads * d * e
    mask_and_table = reqs * width * blocks * bs + reqs * blocks * 8   # the mask: one row per query, bools
    assert facts.min_bytes(attention) == pages + q_and_out + mask_and_table
    reads_cache = [k.name for k in kernels if k.kind == "loop" and any(
        op.op == "load" and op.access.buf == attention.k[0] for op in k.ops)]
    assert reads_cache == []
    paged_attention(q, k, v, cache, grid.meta, 0.25)          # the same writes on the host
    assert torch.equal(card_cache.cpu(), cache)


def test_slot_mapping_on_the_host():
    import torch

    from spyre_rt.serving.host_kernels import compute_slot_mapping

    table = torch.tensor([[3, 5, 0], [1, 2, 0], [0, 0, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 5, 5], dtype=torch.int32)          # two requests; the third slot unused
    positions = torch.tensor([63, 64, 0, 1, 2])
    slots = torch.zeros(8, dtype=torch.int64)
    compute_slot_mapping(5, 8, qsl, positions, table, 3, slots, 64)
    assert slots.tolist() == [3 * 64 + 63, 5 * 64, 64, 65, 66, -1, -1, -1]


def test_plugin_is_chosen_with_a_card_and_by_its_option(monkeypatch):
    from spyre_rt.serving import PLATFORM, register

    monkeypatch.delenv("SPYRE_RT_VLLM", raising=False)
    assert register() == PLATFORM                    # a card is present
    monkeypatch.setenv("SPYRE_RT_VLLM", "0")
    assert register() is None
    monkeypatch.setenv("SPYRE_RT_VLLM", "1")
    assert register() == PLATFORM
    from importlib.metadata import entry_points

    assert [e.value for e in entry_points(group="vllm.platform_plugins") if e.name == "spyre_rt"] == [
        "spyre_rt.serving:register"]


def test_a_steps_grids_are_its_decodes_then_its_prefill_chunks_in_shapes_of_the_set():
    import torch

    from spyre_rt.serving.attention import SpyreStepBatch
    from spyre_rt.serving.steps import Shapes, grids

    shapes = Shapes.of(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=256)
    assert shapes.decode == (2, 4, 8)              # a lone request is padded to two rows
    assert shapes.prefill_grids() == [(2, 64), (2, 128), (4, 64), (2, 256), (4, 128), (8, 64)]
    # requests of 1, 30, 1, 100, 5 and 200 new tokens
    qlen = [1, 30, 1, 100, 5, 200]
    qsl = torch.tensor([0, *torch.tensor(qlen).cumsum(0).tolist()])
    batch = SpyreStepBatch(qsl, torch.tensor(qlen), torch.zeros(6, 4, dtype=torch.int64),
                           torch.arange(int(qsl[-1])), int(qsl[-1]), 6)
    assert shapes.contexts == (4,)                   # 256 tokens in 64-token blocks: one context bucket
    assert list(grids(batch, shapes)) == [([0, 2], 2, 1, 4), ([1, 3, 4], 4, 128, 4), ([5], 2, 256, 4)]


def test_a_grid_reads_the_context_bucket_of_its_longest_request_not_the_longest_length():
    import torch

    from spyre_rt.serving.attention import SpyreStepBatch
    from spyre_rt.serving.bucketing import context_buckets
    from spyre_rt.serving.steps import Shapes, grids, layout

    assert context_buckets(2048, 64, 1024) == [16, 32, 64, 128, 256, 512, 1024, 2048]  # 131,072 tokens
    assert context_buckets(6, 64, 1024) == [6] and context_buckets(6, 64, 0) == [6]
    assert context_buckets(24, 64, 128) == [2, 4, 8, 16, 24]
    with pytest.raises(ValueError):
        context_buckets(0, 64, 128)
    shapes = Shapes.of(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=128, block=64, least_context=128)
    assert shapes.contexts == (2, 4, 8)
    # decodes with every context; a prefill grid with the contexts its longest query can need
    assert shapes.steps() == [(2, 1, 2), (2, 1, 4), (2, 1, 8), (4, 1, 2), (4, 1, 4), (4, 1, 8),
                              (2, 64, 2), (2, 64, 4), (2, 64, 8), (2, 128, 2), (2, 128, 4), (2, 128, 8),
                              (4, 64, 2), (4, 64, 4), (4, 64, 8)]
    # a grid 512 tokens wide holds a query of more than 256: no context of fewer blocks
    wide = Shapes.of(max_num_seqs=2, max_model_len=1024, max_num_batched_tokens=512, block=64, least_context=64)
    assert wide.contexts == (1, 2, 4, 8, 16)
    assert [s for s in wide.steps() if s[1] == 512] == [(2, 512, 8), (2, 512, 16)]
    # two decodes at 100 and 300 tokens, a prefill chunk of 20 tokens ending at 140, one of 70 from 0
    qlen, seq_lens = [1, 1, 20, 70], [100, 300, 140, 70]
    qsl = torch.tensor([0, *torch.tensor(qlen).cumsum(0).tolist()])
    table = torch.arange(4 * 8, dtype=torch.int64).view(4, 8)
    batch = SpyreStepBatch(qsl, torch.tensor(seq_lens), table, torch.arange(int(qsl[-1])), int(qsl[-1]), 4)
    laid = list(grids(batch, shapes))
    assert laid == [([0, 1], 2, 1, 8), ([2, 3], 2, 128, 4)]
    assert all(tuple(shape) in shapes.steps() for _, *shape in laid)
    assert list(grids(SpyreStepBatch(qsl[:2], torch.tensor([100]), table[:1], torch.arange(1), 1, 1), shapes)) == \
        [([0], 2, 1, 2)]
    grid = layout(batch, [2, 3], 2, 128, block=64, spare=99, blocks=4)
    assert grid.blocks == 4 and grid.meta.block_table.tolist() == [table[2, :4].tolist(), table[3, :4].tolist()]


def test_decode_graphs_are_vllms_full_decode_only_with_the_buckets(monkeypatch):
    from vllm.config import CompilationConfig, CUDAGraphMode

    from spyre_rt.serving.platform import SpyrePlatform

    class Config:
        class scheduler_config:  # noqa: N801
            max_num_seqs = 12

    Config.compilation_config = CompilationConfig()
    SpyrePlatform._static_graphs(Config)
    assert Config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert Config.compilation_config.cudagraph_capture_sizes == [2, 4, 8, 12]
    assert SpyrePlatform.support_static_graph_mode()
    assert SpyrePlatform.get_static_graph_wrapper_cls() == "spyre_rt.serving.graphs.SpyreGraphWrapper"
    for off in ({"SPYRE_RT_VLLM_REPLAY": "0"}, {"SPYRE_RT_VLLM_COMPILE": "0"}):
        for k, v in off.items():
            monkeypatch.setenv(k, v)
        Config.compilation_config = CompilationConfig()
        SpyrePlatform._static_graphs(Config)
        assert Config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
        monkeypatch.undo()
    Config.compilation_config = CompilationConfig(cudagraph_mode="NONE")   # the user's choice stands
    SpyrePlatform._static_graphs(Config)
    assert Config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE


def test_vllm_bench_serve_runs_against_the_server(server, tmp_path):
    """vLLM's own load generator, offline against the local server, a bounded number of
    random prompts."""
    run = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
         "--base-url", server["url"], "--model", server["model"], "--dataset-name", "random",
         "--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "8", "--ignore-eos",
         "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"],
        capture_output=True, text=True, timeout=300, env={**_env(), "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 8
    assert result["total_output_tokens"] == 8 * 8


def test_profiler_serve_splits_a_served_decode_step_and_sets_throughput_against_the_roofline(tmp_path):
    """`spyre-profile serve` on the tiny Granite, timing mode: per concurrency and way of running
    the decode grids, the decode step's host time split into vLLM's and ours, the card's time,
    and the throughput beside the roofline of the same work."""
    out = tmp_path / "serve.json"
    run = subprocess.run(
        [sys.executable, "-m", "spyre_rt.profiler.cli", "serve", "granite-tiny", "--timing", "--concurrency", "1,2",
         "--input", "24", "--output", "4", "--compare-output", "3", "--max-num-batched-tokens", "64",
         "--json", str(out), "--trace", str(tmp_path / "serve.trace.json")],
        capture_output=True, text=True, timeout=900, env=_env(),
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    got = json.loads(out.read_text())
    assert got["engine"] == "card" and got["sim_mode"] == "timing" and got["ready_s"] > 0
    for mode in ("replay", "compiled"):
        for c in ("1", "2"):
            r = got["runs"][mode][c]
            # the prefill's token, then a decode step per token (the compiled call's runs: 3 tokens)
            assert r["decode_steps"] == (3 if mode == "replay" else 2)
            d = r["decode"]
            assert d["vllm_ms"] > 0 and d["ours_ms"] > 0 and d["device_ms"] > 0
            assert d["latency_ms"] >= d["host_ms"] > d["ours_ms"]
            assert r["tokens_per_s"] > 0
            assert 0 < r["tokens_per_s"] < got["roofline"][mode][c]["tokens_per_s"]
    assert "decode" in run.stdout and "roofline" in run.stdout
    # the trace: a host span per engine step, prefill steps and decode steps of the whole batch
    spans = {e["name"] for e in json.loads((tmp_path / "serve.trace.json").read_text())["traceEvents"]
             if e.get("ph") == "X" and e.get("name", "").startswith(("step", "decode"))}
    assert any(n.startswith("decode") and "[2 requests, 2 tokens]" in n for n in spans), spans


def test_the_profiler_imports_vllm_only_to_serve():
    code = ("import sys; from spyre_rt.profiler import cli, run; "
            "cli.build_parser().parse_args(['serve', 'granite-tiny']); print('vllm' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.stdout.strip() == "False", run.stderr[-2000:]


def test_moe_experts_in_torch_are_every_tokens_top_k_experts_weighted():
    import torch
    import torch.nn.functional as F

    from spyre_rt.serving.moe import experts, route

    g = torch.Generator().manual_seed(3)
    t, h, inter, n, k = 5, 16, 8, 4, 2
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(n, 2 * inter, h, generator=g)
    w2 = torch.randn(n, h, inter, generator=g)
    logits = torch.randn(t, n, generator=g)
    weights, ids = route(logits, k, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(t))
    assert torch.equal(ids, logits.topk(k, -1).indices)
    want = torch.zeros(t, h)
    for i in range(t):
        for j in range(k):
            e = int(ids[i, j])
            gate, up = (w13[e] @ x[i]).chunk(2)
            want[i] += weights[i, j] * (w2[e] @ (F.silu(gate) * up))
    assert torch.allclose(experts(x, w13, w2, weights, ids), want, atol=1e-4)


# ---- on several cards: vLLM's tensor parallelism, a worker process per card ----

@pytest.mark.parametrize("family, compiled", [("llama", True), ("qwen3_moe", True), ("llama", False)])
def test_llm_on_two_cards_matches_hugging_face(family, compiled, tmp_path, two_card_profile):
    """``LLM(tensor_parallel_size=2)``: the model split over two cards (a ``spyreccl`` group,
    its all-reduces and the logits' all-gather in the steps' plans), Hugging Face's greedy
    tokens for requests alone and together, every decode step replayed on both ranks. With
    Llama, card faults on one rank only (in a prefill, in a decode replay, and at a decode
    step's last command, after its collectives) fail that step's requests on every rank, and
    the group, rearmed, serves the next request. Eager on the cards (``SPYRE_RT_VLLM_COMPILE=0``),
    the collectives are the group's own calls."""
    model = tiny_hf.save_model(family, tmp_path / family)
    expected = [tiny_hf.hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    faults = family == "llama" and compiled
    run = subprocess.run(
        [sys.executable, str(HERE / "vllm_generate.py"), str(tmp_path / family), json.dumps(PROMPTS),
         str(NEW_TOKENS), "tp=2", *(["faults"] if faults else [])],
        capture_output=True, text=True, timeout=600,
        env={**_env(), "SPYRE_RT_DEVICE_PROFILE": two_card_profile, "SPYRE_RT_SIM_MODE": "functional",
             "SPYRE_RT_VLLM_COMPILE": "1" if compiled else "0"},
    )
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, run.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["alone"] == expected[:1]
    assert got["together"] == expected
    assert len(got["decode"]) == 2
    for rank in got["decode"]:
        if compiled:
            assert rank["captures"] == 2 and rank["compiled"] == 0 and rank["replays"] >= 2 * (NEW_TOKENS - 1)
        else:
            assert rank["captures"] == 0 and rank["replays"] == 0 and rank["compiled"] >= 2 * (NEW_TOKENS - 1)
    if faults:
        assert got["faults"]["ended"] == {
            "prefill-0": ["error", 0], "prefill-1": ["error", 0], "decode-0": ["error", 1], "decode-1": ["error", 1],
            "late-0": ["error", 2], "late-1": ["error", 2]}, run.stderr[-3000:]
        assert got["faults"]["after"] == expected[0]
    if compiled:
        assert "runs on the CPU" not in run.stderr, "a step of the split model ran an op on the CPU"


def test_vllm_serve_on_two_cards(tmp_path):
    """``vllm serve --tensor-parallel-size 2``: concurrent completions of different lengths
    and a streamed chat completion give Hugging Face's greedy tokens."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    d = tmp_path / "tiny-granite"
    model = tiny_hf.save_model("granite", d)
    prompts = [[(5 * i + j) % 200 + 4 for j in range(4 + 9 * i)] for i in range(6)]   # 4 to 49 tokens
    expected = [tiny_hf.hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    with serving(d, "--tensor-parallel-size", "2",   # two cards of the default profile
                 env={"SPYRE_RT_DEVICE_COUNT": "2", "SPYRE_RT_SIM_MODE": "functional"}) as server:
        client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="none", timeout=120, max_retries=0)

        def complete(p):
            out = client.completions.create(model=server["model"], prompt=_words(p), max_tokens=NEW_TOKENS,
                                            temperature=0.0, extra_body={**HF_GREEDY, "return_token_ids": True})
            return out.choices[0].token_ids

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(complete, prompts)) == expected
        stream = client.completions.create(model=server["model"], prompt=_words(prompts[1]), max_tokens=NEW_TOKENS,
                                           temperature=0.0, stream=True, extra_body=HF_GREEDY)
        assert "".join(c.choices[0].text for c in stream).strip() == _words(expected[1])


def test_more_ranks_than_cards_is_a_start_up_error(monkeypatch):
    from types import SimpleNamespace

    import torch

    from spyre_rt.serving.platform import SpyrePlatform

    monkeypatch.delenv("SPYRE_RT_VLLM_DEVICE", raising=False)
    cards = torch.spyre.device_count()

    def parallel(tp: int, pp: int = 1, ep: bool = False):
        return SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=1,
                               enable_expert_parallel=ep)

    with pytest.raises(ValueError, match=f"tensor_parallel_size={cards + 1} needs {cards + 1} cards, and the "
                                         f"machine has {cards}; set SPYRE_RT_DEVICE_COUNT={cards + 1}"):
        SpyrePlatform._check_cards(parallel(cards + 1))
    SpyrePlatform._check_cards(parallel(cards))
    with pytest.raises(NotImplementedError, match="pipeline and data parallelism"):
        SpyrePlatform._check_cards(parallel(1, pp=2))
    with pytest.raises(NotImplementedError, match="expert parallelism is not supported"):
        SpyrePlatform._check_cards(parallel(2, ep=True))
