"""Property-based fuzzing of both HTTP servers from their own OpenAPI schemas (schemathesis).

Every operation gets schema-conforming (positive) and schema-violating (negative) requests over one
keep-alive session; no response may be a 5xx (`not_a_server_error`) and every 4xx must be in
OpenAI's error shape (Anthropic's on /v1/messages). /v1/messages and /v1/responses are among the
operations on both servers. Generation is bounded: the tiny model, max_tokens capped at 4 (the fuzzer
asks for anything; the servers refuse more), a fixed number of examples per operation and
derandomized Hypothesis, so a run is reproducible and takes well under a minute on 2 cores.
`/pause` and `/resume` are left out: a paused engine holds generation requests by design; so are
the weight-group routes, whose calls wait for the trainer's end of a broadcast by design
(tests/test_weight_sync.py drives them with a real trainer).
"""

from __future__ import annotations

import collections
import time

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="the `test` extra installs schemathesis")
import requests  # noqa: E402  (a dependency of schemathesis)
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from conftest import SERVE_KEY  # noqa: E402
from tests.http_helpers import ADMIN_KEY, auth, start_session  # noqa: E402

KEY = SERVE_KEY
EXAMPLES = 30  # per operation and generation mode
REQUEST_TIMEOUT_S = 30  # one case; a hung handler fails the test instead of stalling it
BOTH = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)

pytestmark = pytest.mark.timeout(300)  # the first test also starts the servers


class Fuzzer:
    """Runs bounded Hypothesis searches over a schema's operations; counts statuses."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
        self.session = requests.Session()  # one keep-alive connection for every case
        self.statuses: collections.Counter[int] = collections.Counter()
        self.by_path: collections.defaultdict[str, collections.Counter[int]] = \
            collections.defaultdict(collections.Counter)

    def run(self, headers: dict[str, str], modes=BOTH, examples: int = EXAMPLES,
            skip: tuple[str, ...] = (), path_parameters: dict | None = None) -> None:
        for result in self.schema.get_all_operations():
            op = result.ok()
            if op.path in skip:
                continue
            for mode in modes:
                self.search(op, mode, headers, examples, path_parameters)

    def search(self, op, mode, headers, examples, path_parameters) -> None:
        params = {k: v for k, v in (path_parameters or {}).items()
                  if "{" + k + "}" in op.path}

        # No Hypothesis deadline (flaky on shared cores): the request timeout bounds a case.
        @given(case=op.as_strategy(generation_mode=mode, path_parameters=params or None))
        @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate, Phase.shrink],
                  suppress_health_check=list(HealthCheck))
        def one(case) -> None:
            resp = case.call_and_validate(base_url=self.base_url, session=self.session,
                                          headers=headers, checks=[not_a_server_error],
                                          timeout=REQUEST_TIMEOUT_S)
            self.statuses[resp.status_code] += 1
            self.by_path[op.path][resp.status_code] += 1
            if resp.status_code >= 400:
                body = resp.json()
                if op.path == "/v1/messages":  # Anthropic's error shape
                    assert body["type"] == "error" and set(body["error"]) == {
                        "type", "message"}, (op.label, resp.status_code, resp.text[:300])
                    return
                assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(
                    body["error"]), (op.label, resp.status_code, resp.text[:300])

        try:
            one()
        except Unsatisfiable:  # nothing to get wrong (no parameters) in negative mode
            assert mode == GenerationMode.NEGATIVE, op.label


@pytest.mark.slow
def test_fuzz_inference_server(serve_url):
    t0 = time.perf_counter()
    fuzz = Fuzzer(serve_url)
    fuzz.run(auth(KEY), skip=("/pause", "/resume", "/weights/join_group",
                              "/weights/update_distributed"))
    fuzz.run({}, modes=(GenerationMode.POSITIVE,), examples=5)
    print(f"\nasyncrl serve: {sum(fuzz.statuses.values())} requests in "
          f"{time.perf_counter() - t0:.1f} s, statuses {dict(sorted(fuzz.statuses.items()))}")
    assert not any(status >= 500 for status in fuzz.statuses)
    assert fuzz.statuses[200] > 0  # the fuzzer reached the handlers, not only validation
    for path in ("/v1/messages", "/v1/responses"):  # the new APIs' handlers were reached
        assert fuzz.by_path[path][200] > 0, (path, dict(fuzz.by_path[path]))


@pytest.mark.slow
def test_fuzz_proxy(proxy):
    t0 = time.perf_counter()
    fuzz = Fuzzer(proxy.url)
    agent, admin = start_session(proxy), start_session(proxy)
    # Agent's key, its own session id in paths: reaches completions and its own reward.
    fuzz.run(auth(agent["api_key"]), path_parameters={"sid": agent["session_id"]})
    # Admin key on another session: start, reward, end and export reach their handlers.
    fuzz.run(auth(ADMIN_KEY), examples=10, path_parameters={"sid": admin["session_id"]})
    fuzz.run({}, modes=(GenerationMode.POSITIVE,), examples=5)
    print(f"\nproxy: {sum(fuzz.statuses.values())} requests in {time.perf_counter() - t0:.1f} s, "
          f"statuses {dict(sorted(fuzz.statuses.items()))}")
    assert not any(status >= 500 for status in fuzz.statuses)
    assert fuzz.statuses[200] > 0
    for path in ("/v1/messages", "/v1/responses"):  # the new APIs' handlers were reached
        assert fuzz.by_path[path][200] > 0, (path, dict(fuzz.by_path[path]))
