"""Access rules of the server (kvtrim.serve.security): Host allow-list, Origin/CORS, API key, Content-Type."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from live_server import make_engine, running

from kvtrim.errors import InvalidParameterError
from kvtrim.serve.http import create_app
from kvtrim.serve.security import SecurityConfig, _host_name, is_loopback

KEY = "s3cret-key"
ALLOWED_ORIGIN = "http://localhost:3000"
BODY = {"prompt": "hi", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    engine = make_engine()
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def open_url(engine):
    """Default rules: loopback Host names only, no API key, CORS off."""
    with running(create_app(engine, manage_engine=False)) as url:
        yield url


@pytest.fixture(scope="module")
def locked_url(engine):
    security = SecurityConfig.for_bind("127.0.0.1", KEY, ("box.lan",), (ALLOWED_ORIGIN,))
    with running(create_app(engine, manage_engine=False, security=security)) as url:
        yield url


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"]
    return error


# ----------------------------------------------------------------------------------------- content type
def test_post_needs_application_json(open_url):
    with httpx.Client(base_url=open_url) as http:
        raw = json.dumps(BODY)
        _error(
            http.post("/v1/completions", content=raw, headers={"content-type": "text/plain"}),
            415,
            "unsupported_media_type",
        )
        _error(http.post("/v1/completions", content=raw), 415, "unsupported_media_type")
        ok = http.post("/v1/completions", content=raw, headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200, ok.text


# ------------------------------------------------------------------------------------------- host / origin
def test_host_allow_list_on_loopback(open_url):
    with httpx.Client(base_url=open_url) as http:
        error = _error(http.get("/health", headers={"host": "evil.example"}), 400, "host_not_allowed")
        assert "evil.example" in error["message"] and "--allowed-hosts" in error["message"]
        _error(http.get("/health", headers={"host": "localhost.evil.example:80"}), 400, "host_not_allowed")
        for host in ("localhost:1234", "127.0.0.1", "[::1]:8000", "LOCALHOST"):
            assert http.get("/health", headers={"host": host}).status_code == 200, host


def test_browser_attack_of_issue_17_is_refused(open_url):
    """text/plain + foreign Origin + foreign Host used to start a generation (200)."""
    headers = {"content-type": "text/plain", "origin": "http://evil.example", "host": "evil.example"}
    with httpx.Client(base_url=open_url) as http:
        r = http.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": 2}', headers=headers)
        assert r.status_code == 400
        # with a legitimate Host (DNS rebinding aside) the foreign Origin is still refused, JSON or not
        r = http.post("/v1/completions", json=BODY, headers={"origin": "http://evil.example"})
        _error(r, 403, "origin_not_allowed")


def test_cors_is_off_by_default(open_url):
    with httpx.Client(base_url=open_url) as http:
        preflight = http.options(
            "/v1/completions",
            headers={"origin": "http://evil.example", "access-control-request-method": "POST"},
        )
        assert preflight.status_code >= 400
        assert "access-control-allow-origin" not in preflight.headers
        assert "access-control-allow-origin" not in http.post("/v1/completions", json=BODY).headers


def test_no_api_key_needed_by_default(open_url):
    with httpx.Client(base_url=open_url) as http:
        assert http.get("/v1/models").status_code == 200


# ------------------------------------------------------------------------------------------------- API key
def test_api_key_guards_v1(locked_url):
    with httpx.Client(base_url=locked_url) as http:
        r = http.get("/v1/models")
        error = _error(r, 401, "invalid_api_key")
        assert "--api-key" in error["message"] and r.headers["www-authenticate"] == "Bearer"
        _error(http.get("/v1/models", headers={"authorization": "Bearer wrong"}), 401, "invalid_api_key")
        _error(http.get("/v1/models", headers={"authorization": f"Basic {KEY}"}), 401, "invalid_api_key")
        _error(http.get("/v1/models", headers={"authorization": f"Bearer {KEY}x"}), 401, "invalid_api_key")
        _error(http.post("/v1/completions", json=BODY), 401, "invalid_api_key")
        assert http.get("/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        assert http.get("/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200
        r = http.post("/v1/completions", json=BODY, headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
        # as in vLLM, /health and /metrics stay open (load balancers, Prometheus)
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200


def test_openai_client_with_api_key(locked_url):
    import openai

    good = openai.OpenAI(base_url=f"{locked_url}/v1", api_key=KEY, max_retries=0, timeout=30)
    assert good.completions.create(model=good.models.list().data[0].id, prompt="x", max_tokens=2).choices
    bad = openai.OpenAI(base_url=f"{locked_url}/v1", api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_extra_allowed_host(locked_url):
    with httpx.Client(base_url=locked_url) as http:
        assert http.get("/health", headers={"host": "box.lan:8000"}).status_code == 200
        _error(http.get("/health", headers={"host": "evil.example"}), 400, "host_not_allowed")


# ---------------------------------------------------------------------------------------------------- CORS
def test_cors_preflight_and_simple_requests(locked_url):
    preflight_headers = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    with httpx.Client(base_url=locked_url) as http:
        ok = http.options("/v1/completions", headers={"origin": ALLOWED_ORIGIN, **preflight_headers})
        assert ok.status_code == 200, ok.text
        assert ok.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        assert "POST" in ok.headers["access-control-allow-methods"]
        refused = http.options("/v1/completions", headers={"origin": "http://evil.example", **preflight_headers})
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        auth = {"authorization": f"Bearer {KEY}"}
        r = http.post("/v1/completions", json=BODY, headers={"origin": ALLOWED_ORIGIN, **auth})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        r = http.post("/v1/completions", json=BODY, headers={"origin": "http://evil.example", **auth})
        _error(r, 403, "origin_not_allowed")


# ------------------------------------------------------------------------------------------------- config
def test_security_config():
    assert is_loopback("127.0.0.1") and is_loopback("127.8.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4") and not is_loopback("example.com")
    assert SecurityConfig.for_bind("0.0.0.0").allowed_hosts is None
    assert SecurityConfig.for_bind("0.0.0.0", extra_hosts=("box.lan",)).allowed_hosts == ("box.lan",)
    assert SecurityConfig.for_bind("::1").allowed_hosts == ("localhost", "127.0.0.1", "[::1]")
    assert SecurityConfig(allowed_hosts=("localhost", "*")).allowed_hosts is None
    assert SecurityConfig.for_bind("127.0.0.1", api_key="").api_key is None
    assert [_host_name(h) for h in ("a.b:80", "[::1]:9", "[::1]", "LocalHost", "")] == [
        "a.b",
        "[::1]",
        "[::1]",
        "localhost",
        "",
    ]
    with pytest.raises(InvalidParameterError, match="api_key"):
        SecurityConfig(api_key="  ")
