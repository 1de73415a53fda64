"""tools/run_text_generation_server.py under torchrun: a TP2 server answers the same as the one-process
server (tests/e2e/conftest.py's ``server``, over the same checkpoint), OpenAI beam search included, and
every rank exits with code 0 on SIGTERM to the serving rank; its stream joins to the same text and
log-probs (each step's broadcast to every rank), best_of picks the same choices, concurrent requests
(continuous batching, the server's default) answer as one process does, and a client leaving
mid-stream leaves every rank serving.
"""

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from tests.e2e.conftest import PROMPTS, ROOT
from tests.harness import free_port
from tests.inference_helpers import assert_close

httpx = pytest.importorskip("httpx")
pytest.importorskip("flask")


def _read_until_serving(proc, timeout_s=420):
    lines = []
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("serving "):
                return line, lines
    finally:
        timer.cancel()
    raise AssertionError("the server did not start:\n" + "".join(lines[-40:]))


def _streamed_logprobs_match(address, url):
    """A streamed request's chunk logprobs, joined per choice, are the TP2 server's non-streamed ones
    (the same numbers) and the one-process server's (1e-5): greedy with echo, and seeded samples."""
    for request in ({"prompt": PROMPTS, "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": True},
                    {"prompt": PROMPTS[1], "max_tokens": 5, "n": 2, "temperature": 1.3, "seed": 3, "logprobs": 1}):
        whole = httpx.post(address + "/v1/completions", json=request, timeout=120).json()["choices"]
        alone = httpx.post(url + "/v1/completions", json=request).json()["choices"]
        streamed = httpx.post(address + "/v1/completions", json={**request, "stream": True}, timeout=120).text
        joined = {}
        for block in streamed.split("\n\n"):
            if block.startswith("data: {"):
                for c in json.loads(block[len("data: "):])["choices"]:
                    mine = joined.setdefault(c["index"], {})
                    for key, value in c["logprobs"].items():
                        mine[key] = mine.get(key, []) + (value or [])
        assert len(joined) == len(whole) == len(alone)
        for c, one in zip(whole, alone):
            assert joined[c["index"]] == {key: value or [] for key, value in c["logprobs"].items()}
            assert c["logprobs"]["tokens"] == one["logprobs"]["tokens"] and len(c["logprobs"]["tokens"]) >= 5
            assert_close(torch.tensor(c["logprobs"]["token_logprobs"][1:]),
                         torch.tensor(one["logprobs"]["token_logprobs"][1:]))


def test_tp2_server_under_torchrun_answers_like_one_process(server, checkpoint):
    url = server[0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "tools/run_text_generation_server.py", "--load", checkpoint, "--port", "0",
           "--tensor-model-parallel-size", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MEGATRON_LITE_DEVICE="cpu")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line, _ = _read_until_serving(proc)
        address = line.split(" on ")[1].split()[0]
        pid = int(line.split("(pid ")[1].split(",")[0])
        api = {"prompts": PROMPTS, "tokens_to_generate": 6, "logprobs": True, "top_k": 4, "random_seed": 2}
        completion = {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "logprobs": 1}
        for path, method, body in (("/api", "PUT", api), ("/v1/completions", "POST", completion)):
            got = httpx.request(method, address + path, json=body, timeout=120).json()
            want = httpx.request(method, url + path, json=body).json()
            if path == "/api":
                assert got["tokens"] == want["tokens"] and got["text"] == want["text"]
                for a, b in zip(got["logprobs"], want["logprobs"]):
                    assert_close(torch.tensor(a), torch.tensor(b))
            else:
                assert got["choices"][0]["text"] == want["choices"][0]["text"]
        streamed = httpx.post(address + "/v1/completions", json={**completion, "logprobs": None, "stream": True},
                              timeout=120).text
        chunks = [json.loads(b[len("data: "):]) for b in streamed.split("\n\n") if b.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == want["choices"][0]["text"]
        _streamed_logprobs_match(address, url)
        burst = [dict(completion, prompt=p, max_tokens=m) for p, m in ((PROMPTS[0], 9), (PROMPTS[1], 3), ("2 7", 6))]
        answers = [None] * len(burst)  # sent at once: they decode together (continuous batching) at TP2
        threads = [threading.Thread(target=lambda i=i: answers.__setitem__(
            i, httpx.post(address + "/v1/completions", json=burst[i], timeout=120).json())) for i in range(len(burst))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        for body, answer in zip(burst, answers):
            alone = httpx.post(url + "/v1/completions", json=body).json()
            assert answer["choices"][0]["text"] == alone["choices"][0]["text"]
            assert_close(torch.tensor(answer["choices"][0]["logprobs"]["token_logprobs"]),
                         torch.tensor(alone["choices"][0]["logprobs"]["token_logprobs"]))
        best = {"prompt": PROMPTS, "n": 2, "best_of": 3, "max_tokens": 5, "temperature": 1.3, "seed": 7}
        got = httpx.post(address + "/v1/completions", json=best, timeout=120).json()["choices"]
        alone = httpx.post(url + "/v1/completions", json=best).json()["choices"]
        assert [c["text"] for c in got] == [c["text"] for c in alone] and len(got) == 4
        beams = {"prompt": PROMPTS, "use_beam_search": True, "n": 2, "best_of": 3, "max_tokens": 4, "logprobs": 1}
        got = httpx.post(address + "/v1/completions", json=beams, timeout=120).json()["choices"]  # every rank scores
        alone = httpx.post(url + "/v1/completions", json=beams).json()["choices"]
        assert [c["text"] for c in got] == [c["text"] for c in alone] and len(got) == 4
        for c, one in zip(got, alone):
            assert_close(torch.tensor(c["logprobs"]["token_logprobs"]), torch.tensor(one["logprobs"]["token_logprobs"]))
        with httpx.stream("POST", address + "/v1/completions", timeout=120,  # leave after the first event
                          json={"prompt": PROMPTS[1], "max_tokens": 60, "stream": True}) as r:
            next(r.iter_lines())
        after = httpx.post(address + "/v1/completions", json=completion, timeout=120).json()  # every rank in step
        assert after["choices"][0]["text"] == want["choices"][0]["text"]
        bad = httpx.put(address + "/api", json={"prompts": ["1"], "top_k": 2, "top_p": 0.5}, timeout=60)
        assert bad.status_code == 400
        os.kill(pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "server stopped" in out
