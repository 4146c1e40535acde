"""What clients get back from both HTTP servers (`asyncrl serve` and the agent proxy) when they send
something wrong: a 4xx in OpenAI's error shape naming the field, never a 5xx, and the keep-alive
connection stays usable for the next request. Also the inference server's API key on `/v1/*`.

Each case runs against both servers on one `httpx.Client` (one pooled connection), so a server
that closes the connection after an error fails the follow-up request.
"""

from __future__ import annotations

import httpx
import pytest

from conftest import SERVE_KEY

from tests.http_helpers import auth, start_session

KEY = SERVE_KEY
MSGS = [{"role": "user", "content": "hi"}]
GOOD_CHAT = {"messages": MSGS, "max_tokens": 2}


@pytest.fixture(params=["serve", "proxy"])
def target(request, serve_url, proxy):
    """(client bound to the server root with the key that reaches the handlers, its /v1 path)."""
    if request.param == "serve":
        base, headers = serve_url, auth(KEY)
    else:
        base, headers = proxy.url, auth(start_session(proxy)["api_key"])
    # One connection: a server that drops it after an error fails the follow-up request.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with httpx.Client(base_url=base, headers=headers, timeout=60, limits=limits) as client:
        yield client


def openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error"), err
    return err


def post_json(client: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


def assert_still_serving(client: httpx.Client) -> None:
    """The next request on the same keep-alive connection succeeds."""
    resp = client.post("/v1/chat/completions", json=GOOD_CHAT)
    assert resp.status_code == 200, resp.text
    assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200


# ---- bad fields: 400 naming the field ------------------------------------------------------------

@pytest.mark.parametrize("body, field", [
    ({"messages": MSGS, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": MSGS, "tools": [{"type": "function", "function": {}}]},
     "tools[0].function.name"),
    ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": 3}}]},
     "tools[0].function.name"),
    ({"messages": MSGS, "tools": [{"type": "retrieval", "function": {"name": "f"}}]},
     "tools[0].type"),
    ({"messages": MSGS, "tools": "calc"}, "tools"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]}]},
     "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": "x"}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content"),
])
def test_malformed_tools_and_messages_are_400_naming_the_field(target, body, field):
    err = openai_error(target.post("/v1/chat/completions", json={**body, "max_tokens": 2}), 400)
    assert field in err["message"] and err["param"].startswith(field), err
    assert_still_serving(target)


def test_a_role_the_chat_template_refuses_is_400(target):
    # "developer" is an OpenAI role; this model's chat template raises for it (a jinja error).
    body = {"messages": [{"role": "developer", "content": "x"}], "max_tokens": 2}
    err = openai_error(target.post("/v1/chat/completions", json=body), 400)
    assert "chat template" in err["message"] and "developer" in err["message"], err
    assert_still_serving(target)


@pytest.mark.parametrize("path, raw, field", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages[0].content"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stop": "\\ud800"}',
     "stop"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "metadata": {"\\ud800": "v"}}',
     "metadata"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"tools": [{"type": "function", "function": {"name": "f", "description": "\\udc00"}}]}',
     "tools[0].function.description"),
    ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\ud800x"]}', "prompt[1]"),
    ("/v1/completions", b'{"prompt": "ab", "stop": ["\\ud800"]}', "stop[0]"),
    ("/v1/completions", b'{"prompt": "ab", "user": "\\ud800"}', "user"),
])
def test_lone_surrogates_are_400_naming_the_field(target, path, raw, field):
    raw = raw[:-1] + b', "max_tokens": 2}'
    err = openai_error(post_json(target, path, raw), 400)
    assert field in err["message"] and err["param"] == field, err
    assert "surrogate" in err["message"], err
    assert_still_serving(target)


def test_generate_rejects_lone_surrogates_too(serve_url):
    with httpx.Client(base_url=serve_url, headers=auth(KEY), timeout=60) as client:
        resp = post_json(client, "/generate", b'{"input_ids": [3, 4], "rid": "\\ud800"}')
        err = openai_error(resp, 400)
        assert err["param"] == "rid", err
        good = client.post("/generate", json={"input_ids": [3], "max_new_tokens": 1})
        assert good.status_code == 200, good.text


# ---- bodies that are not what the route takes ----------------------------------------------------

def test_deep_nesting_is_400_in_openai_shape(target):
    deep = b"[" * 100_000 + b"]" * 100_000
    openai_error(post_json(target, "/v1/chat/completions", deep), 400)
    # Deep enough for recursive code past the parser (serialisers, templates), not for the parser.
    params = b'{"a": ' + b"[" * 500 + b"]" * 500 + b"}"
    nested = (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
              b'"function": {"name": "f", "parameters": ' + params + b"}}]}")
    err = openai_error(post_json(target, "/v1/chat/completions", nested), 400)
    assert err["param"].startswith("tools[0].function.parameters.a") and "deep" in err["message"]
    assert_still_serving(target)


def test_malformed_json_and_wrong_content_type_are_400_in_openai_shape(target):
    err = openai_error(post_json(target, "/v1/chat/completions", b'{"messages": [1,'), 400)
    assert "JSON" in err["message"], err
    resp = target.post("/v1/chat/completions", content=b"hello",
                       headers={"Content-Type": "text/plain"})
    err = openai_error(resp, 400)
    assert "application/json" in err["message"], err
    openai_error(post_json(target, "/v1/chat/completions", b"[1, 2]"), 400)
    assert_still_serving(target)


def test_a_chunked_body_over_the_limit_is_413(target):
    # No Content-Length: the limit is enforced while the body streams in (FastAPI used to turn
    # that into a 400 "There was an error parsing the body").
    chunks = (b"x" * 100_000 for _ in range(50))
    resp = target.post("/v1/completions", content=chunks,
                       headers={"Content-Type": "application/json"})
    assert "limit" in openai_error(resp, 413)["message"]
    assert_still_serving(target)


def test_unknown_route_and_wrong_method_are_openai_shaped(target):
    err = openai_error(target.get("/v1/nope"), 404)
    assert "/v1/nope" in err["message"], err
    resp = target.delete("/v1/chat/completions")
    openai_error(resp, 405)
    assert "POST" in resp.headers.get("allow", ""), resp.headers
    assert_still_serving(target)


# ---- unexpected errors: a 500 in OpenAI's shape, the connection kept -----------------------------

def test_an_unexpected_exception_is_a_500_and_the_connection_survives(target, monkeypatch):
    import asyncrl.inference.openai_routes as serve_routes
    import asyncrl.proxy.routes as proxy_routes

    def boom(*args, **kwargs):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(serve_routes, "encode_chat_prompt", boom)
    monkeypatch.setattr(proxy_routes, "build_prompt", boom)
    err = openai_error(target.post("/v1/chat/completions", json=GOOD_CHAT), 500)
    assert "internal" in err["message"].lower(), err
    # Same connection, another route: still served.
    assert target.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200


# ---- the inference server's API key --------------------------------------------------------------

@pytest.mark.parametrize("method, path, body", [
    ("POST", "/v1/chat/completions", GOOD_CHAT),
    ("POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("POST", "/generate", {"input_ids": [3, 4], "max_new_tokens": 1}),
])
def test_api_key_protects_generation_routes(serve_url, method, path, body):
    for headers in ({}, auth("wrong")):
        resp = httpx.request(method, serve_url + path, json=body, headers=headers, timeout=60)
        err = openai_error(resp, 401)
        assert "key" in err["message"], err
    resp = httpx.request(method, serve_url + path, json=body, headers=auth(KEY), timeout=60)
    assert resp.status_code == 200, resp.text


def test_health_and_metrics_stay_open(serve_url):
    assert httpx.get(serve_url + "/health").status_code == 200
    assert httpx.get(serve_url + "/metrics").status_code == 200


def test_image_parts_for_a_text_policy_are_400(target):
    """`asyncrl serve` takes text prompts; the proxy of a text-only policy refuses images."""
    url = "data:image/png;base64,iVBORw0KGgo="
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}]}],
        "max_tokens": 2}
    err = openai_error(target.post("/v1/chat/completions", json=body), 400)
    assert "image_url" in err["message"], err
    assert_still_serving(target)
