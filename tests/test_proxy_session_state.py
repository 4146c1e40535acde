"""The proxy's answers that depend on a session's state, over real HTTP: an ended session refuses
every route its key reaches (403, OpenAI's error shape) while it may still be rewarded; an unknown
session or completion is a 404; an internal KeyError is a bug, answered 500, never a 404."""

from __future__ import annotations

import httpx
import pytest

from tests.http_helpers import ADMIN_KEY, auth, proxy_server, start_session

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def proxy(model_dir, one_thread):
    with proxy_server(model_dir) as p:
        yield p


def error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error"), err
    return err


def test_an_ended_session_refuses_every_route_of_its_key(proxy):
    s = start_session(proxy)
    key, sid = auth(s["api_key"]), s["session_id"]
    first = httpx.post(f"{proxy.base_url}/chat/completions", headers=key,
                       json={"messages": MSGS, "max_tokens": 2})
    assert first.status_code == 200, first.text
    ended = httpx.post(f"{proxy.url}/sessions/{sid}/end", headers=auth(ADMIN_KEY))
    assert ended.status_code == 200, ended.text
    calls = [("POST", "/chat/completions", {"messages": MSGS, "max_tokens": 2}),
             ("POST", "/completions", {"prompt": "ab", "max_tokens": 2}),
             ("GET", f"/chat/completions/{first.json()['id']}", None),
             ("GET", "/models", None)]
    for method, path, body in calls:
        resp = httpx.request(method, proxy.base_url + path, headers=key, json=body)
        err = error(resp, 403)
        assert f"session {sid} has ended" in err["message"], (path, err)
    # The run is over but its reward may still be set, by the session itself or the admin.
    resp = httpx.post(f"{proxy.url}/sessions/{sid}/reward", headers=key, json={"reward": 1.0})
    assert resp.status_code == 200, resp.text
    samples = httpx.post(f"{proxy.url}/sessions/{sid}/export", headers=auth(ADMIN_KEY),
                         json={}).json()["samples"]
    assert [smp["reward"] for smp in samples] == [1.0]


def test_unknown_session_and_completion_are_404(proxy):
    for path in ("/sessions/0123456789abcdef/end", "/sessions/0123456789abcdef/export"):
        err = error(httpx.post(proxy.url + path, headers=auth(ADMIN_KEY), json={}), 404)
        assert "session '0123456789abcdef' does not exist" in err["message"], err
    err = error(httpx.post(f"{proxy.url}/sessions/0123456789abcdef/reward",
                           headers=auth(ADMIN_KEY), json={"reward": 1.0}), 404)
    s = start_session(proxy)
    resp = httpx.get(f"{proxy.base_url}/chat/completions/chatcmpl-nope",
                     headers=auth(s["api_key"]))
    assert "chatcmpl-nope" in error(resp, 404)["message"]


def test_an_internal_key_error_is_a_500_not_a_404(proxy, monkeypatch):
    import asyncrl.proxy.routes as routes

    def buggy(*args, **kwargs):
        return {}["missing"]  # a bug inside the handler, not an unknown resource

    monkeypatch.setattr(routes, "build_prompt", buggy)
    s = start_session(proxy)
    resp = httpx.post(f"{proxy.base_url}/chat/completions", headers=auth(s["api_key"]),
                      json={"messages": MSGS, "max_tokens": 2})
    err = error(resp, 500)
    assert "internal" in err["message"] and "KeyError" in err["message"], err
