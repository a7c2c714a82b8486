"""Five security and robustness probes (docs/server.md) against real ``kvtrim serve`` processes (SmolLM2-135M).

1. A huge request while a stream runs: a 5 MB prompt (refused by size), a 90,000-character prompt (under the
   character cap: tokenized, then refused by the model's context), 17 prompts in one request. Per probe: status,
   seconds to the answer, the longest pause of a concurrent stream while it ran, the server's RSS growth.
2. A 1,501-token prompt arriving while a stream runs: the stream's longest pause (chunked prefill in the engine).
3. Browser-style requests (``text/plain``, foreign ``Origin``, foreign ``Host``) and the API key.
4. Lone surrogates, 100,000-deep JSON, and keep-alive reuse after an error (8 tries).
5. Shutdown: SIGTERM while a 300-token stream runs (default drain), a second SIGTERM, SIGTERM when idle.

Writes ``probe.json`` and ``probe.md`` to ``benchmarks/results/bench_server_probe/``. Usage::

    python benchmarks/bench_server_probe.py [--model smollm2-135m] [--threads 1] [--findings 1,2,3,4,5]
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import itertools
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

OUT_DIR = Path(__file__).parent / "results" / "bench_server_probe"
JSON_CT = {"content-type": "application/json"}


# ------------------------------------------------------------------------------------------------ plumbing
class Server:
    """One ``kvtrim serve`` subprocess on a free 127.0.0.1 port."""

    def __init__(self, model: str, threads: int, *extra: str):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvtrim", "serve", "--model", model, "--port", str(self.port)]
        cmd += ["--threads", str(threads), "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.headers = (
            {"authorization": f"Bearer {extra[extra.index('--api-key') + 1]}"} if "--api-key" in extra else {}
        )
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.communicate()[1][-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("server did not come up in 300 s")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)

    def rss_mib(self, field: str = "VmRSS") -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> tuple[int, float]:
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        self.proc.communicate(timeout=timeout)
        return self.proc.returncode, time.monotonic() - t0


class Stream(threading.Thread):
    """A greedy streaming completion; records the arrival time of every SSE event."""

    def __init__(self, url: str, max_tokens: int, headers: dict | None = None):
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.headers = url, max_tokens, headers or {}
        self.times: list[float] = []
        self.payloads: list = []
        self.first = threading.Event()
        self.closing = threading.Event()  # set: stop reading and drop the connection (the server cancels)
        self.error: str | None = None

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": self.max_tokens, "temperature": 0, "stream": True}
        body["ignore_eos"] = True
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, headers=self.headers, timeout=600) as r:
                for line in r.iter_lines():
                    if self.closing.is_set():
                        break
                    if line.startswith("data: "):
                        self.times.append(time.monotonic())
                        data = line[6:]
                        self.payloads.append(data if data == "[DONE]" else json.loads(data))
                        self.first.set()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        self.first.set()

    def max_gap(self, start: float, end: float) -> float:
        """Longest pause between events that overlaps [start, end] (a pause still open now counts)."""
        times = [*self.times, time.monotonic()] if self.is_alive() else self.times
        gaps = [b - a for a, b in itertools.pairwise(times) if b >= start and a <= end]
        return max(gaps, default=float("nan"))

    def median_gap(self) -> float:
        gaps = [b - a for a, b in itertools.pairwise(self.times)]
        return statistics.median(gaps) if gaps else float("nan")

    def ending(self) -> dict:
        last = self.payloads[-2:] if len(self.payloads) >= 2 else self.payloads
        error = next((p["error"] for p in last if isinstance(p, dict) and "error" in p), None)
        tokens = sum(1 for p in self.payloads if isinstance(p, dict) and "choices" in p)
        return {"done": bool(self.payloads) and self.payloads[-1] == "[DONE]", "error_event": error, "events": tokens}


def timed_post(server: Server, path: str, content: bytes, headers: dict | None = None) -> dict:
    t0 = time.monotonic()
    r = httpx.post(server.url + path, content=content, headers={**JSON_CT, **server.headers, **(headers or {})},
                   timeout=600)  # fmt: skip
    seconds = time.monotonic() - t0
    try:
        error = r.json().get("error")
    except ValueError:
        error = None
    return {"status": r.status_code, "seconds": round(seconds, 3), "error": error and error.get("message", "")[:200]}


def under_stream(server: Server, probe) -> dict:
    """Run ``probe()`` while a stream runs; add the stream's longest pause and the RSS growth."""
    stream = Stream(server.url, 400, server.headers)
    stream.start()
    stream.first.wait(120)
    time.sleep(1.0)  # a baseline of normal gaps
    rss0 = server.rss_mib()
    t0 = time.monotonic()
    result = probe()
    t1 = time.monotonic()
    result["stream_median_gap_s"] = round(stream.median_gap(), 4)
    result["rss_growth_mib"] = round(server.rss_mib() - rss0, 1)
    time.sleep(0.5)
    result["stream_max_gap_s"] = round(stream.max_gap(t0, t1), 3)
    stream.closing.set()
    stream.join(600)
    return result


# --------------------------------------------------------------------------------------------------- findings
def finding_1(server: Server) -> dict:
    huge = json.dumps({"prompt": "word " * 1_000_000, "max_tokens": 4}).encode()  # 5 MB
    big = json.dumps({"prompt": "word " * 18_000, "max_tokens": 4}).encode()  # 90,000 characters
    many = json.dumps({"prompt": ["hello"] * 17, "max_tokens": 2}).encode()
    return {
        "5MB_prompt": {"bytes": len(huge), **under_stream(server, lambda: timed_post(server, "/v1/completions", huge))},
        "90k_char_prompt": {
            "bytes": len(big),
            **under_stream(server, lambda: timed_post(server, "/v1/completions", big)),
        },
        "17_prompts": timed_post(server, "/v1/completions", many),
    }


def finding_2(server: Server, model: str) -> dict:
    from kvtrim.eval.haystacks import get_haystack
    from kvtrim.models import load_tokenizer

    tokenizer = load_tokenizer(model)
    ids = tokenizer(get_haystack("jargon")[:20_000])["input_ids"][:1501]
    body = json.dumps({"prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
    return {"prompt_tokens": len(ids), **under_stream(server, lambda: timed_post(server, "/v1/completions", body))}


def finding_3(server: Server, keyed: Server) -> dict:
    body = b'{"prompt": "hi", "max_tokens": 2}'
    attack = {"content-type": "text/plain", "origin": "http://evil.example", "host": "evil.example"}
    out = {"issue_request (text/plain + Origin + Host evil)": httpx.post(server.url + "/v1/completions", content=body,
                                                                        headers=attack).status_code}  # fmt: skip
    for name, headers in (
        ("text/plain only", {"content-type": "text/plain"}),
        ("Origin evil only", {**JSON_CT, "origin": "http://evil.example"}),
        ("Host evil only", {**JSON_CT, "host": "evil.example"}),
        ("no Content-Type", {}),
    ):
        out[name] = httpx.post(server.url + "/v1/completions", content=body, headers=headers).status_code
    preflight = httpx.options(
        server.url + "/v1/completions",
        headers={"origin": "http://evil.example", "access-control-request-method": "POST"},
    )
    out["CORS preflight from evil origin"] = preflight.status_code
    out["preflight allow-origin header"] = preflight.headers.get("access-control-allow-origin")
    out["api key: none"] = httpx.post(keyed.url + "/v1/completions", content=body, headers=JSON_CT).status_code
    out["api key: wrong"] = httpx.post(
        keyed.url + "/v1/completions", content=body, headers={**JSON_CT, "authorization": "Bearer wrong"}
    ).status_code
    out["api key: right"] = httpx.post(
        keyed.url + "/v1/completions", content=body, headers={**JSON_CT, **keyed.headers}
    ).status_code
    out["api key: /metrics without key"] = httpx.get(keyed.url + "/metrics").status_code
    return out


def finding_4(server: Server) -> dict:
    out = {
        "surrogate prompt": timed_post(server, "/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
        "surrogate chat": timed_post(
            server, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'
        ),
        "json 100000 deep": timed_post(server, "/v1/completions", b"[" * 100_000 + b"]" * 100_000),
    }
    resets = 0
    bad = [b'{"prompt": "\\ud800"}', b"[" * 100_000 + b"]" * 100_000]
    for i in range(8):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", body=bad[i % 2], headers=JSON_CT)
            first = conn.getresponse()
            first.read()
            sock = conn.sock
            conn.request("POST", "/v1/completions", body=b'{"prompt": "ok", "max_tokens": 2}', headers=JSON_CT)
            second = conn.getresponse()
            second.read()
            if second.status != 200 or conn.sock is not sock:
                resets += 1
        except (ConnectionError, http.client.HTTPException):
            resets += 1
        finally:
            conn.close()
    out["keep-alive resets after an error (of 8)"] = resets
    return out


def finding_5(model: str, threads: int, main: Server) -> dict:
    out = {}
    stream = Stream(main.url, 300)
    stream.start()
    stream.first.wait(120)
    code, seconds = main.stop(signal.SIGTERM)
    stream.join(60)
    out["SIGTERM with a 300-token stream (default --shutdown-timeout 5)"] = {
        "exit_status": code, "seconds_to_exit": round(seconds, 2), **stream.ending()
    }  # fmt: skip

    server = Server(model, threads, "--shutdown-timeout", "120")
    stream = Stream(server.url, 300)
    stream.start()
    stream.first.wait(120)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    code, seconds = server.stop(signal.SIGTERM)
    stream.join(60)
    out["second SIGTERM 1 s after the first (--shutdown-timeout 120)"] = {
        "exit_status": code, "seconds_to_exit_after_second": round(seconds, 2), **stream.ending()
    }  # fmt: skip

    server = Server(model, threads)
    time.sleep(0.5)
    code, seconds = server.stop(signal.SIGTERM)
    out["SIGTERM when idle"] = {"exit_status": code, "seconds_to_exit": round(seconds, 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--findings", default="1,2,3,4,5", help="comma-separated findings to re-run, e.g. 2")
    args = parser.parse_args()
    chosen = {int(f) for f in args.findings.split(",")}
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start "
        "(shared with other jobs: timings under load)",
        "model": args.model,
        "threads": args.threads,
        "command": " ".join(["python", *sys.argv]),
    }
    main_server = Server(args.model, args.threads)
    keyed = Server(args.model, args.threads, "--api-key", "probe-key") if 3 in chosen else None
    steps = {
        1: ("1 huge request", lambda: finding_1(main_server)),
        2: ("2 long prefill", lambda: finding_2(main_server, args.model)),
        3: ("3 browsers and auth", lambda: finding_3(main_server, keyed)),
        4: ("4 malformed input", lambda: finding_4(main_server)),
        5: ("5 shutdown", lambda: finding_5(args.model, args.threads, main_server)),
    }
    try:
        for number in sorted(chosen):
            if number == 5 and keyed is not None:
                keyed.stop()
            name, run = steps[number]
            results[name] = run()
            print(json.dumps({name: results[name]}, indent=1), flush=True)
    finally:
        for s in (main_server, keyed):
            if s is not None and s.proc.poll() is None:
                s.proc.kill()
    results["load average at end"] = round(os.getloadavg()[0], 1)
    (OUT_DIR / "probe.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# kvtrim serve probe, {results['date']}", "", f"{results['machine']}; model {args.model}, "
             f"--threads {args.threads}", ""]  # fmt: skip
    for key, value in results.items():
        if isinstance(value, dict):
            lines += [f"## {key}", "", "```json", json.dumps(value, indent=2), "```", ""]
    (OUT_DIR / "probe.md").write_text("\n".join(lines))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
