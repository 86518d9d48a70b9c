"""SGLangEngine's HTTP timeouts and attach checks against fake servers on 127.0.0.1 (tests/sglang/fake_server.py):
a server that accepts connections and never answers is lost after --sglang-http-timeout (a /generate call after
that plus max_new_tokens / --sglang-min-tokens-per-s), not after an hour; attaching to something that is not SGLang
is an error naming the URL and its answer; a dead router is logged once and counted in rollout/router_fallbacks.

Each engine call that used to hang runs on a thread joined with a deadline, so a regression fails the test
instead of stalling the suite for the old 3600 s per request."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from megatron_dapo.arguments import build_parser
from megatron_dapo.errors import UserError
from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams
from tests.sglang.fake_server import kill, serve

DEADLINE_S = 60.0
"""How long a call that must fail fast may take here before the test calls it a hang (the old code: 3600 s)."""


def _reqs(count: int, n: int = 2, max_new: int = 5) -> list[RolloutRequest]:
    sp = SamplingParams(max_new_tokens=max_new)
    return [RolloutRequest(prompt_ids=[3, 4, i + 1], n=n, sampling=sp, request_id=f"p{i}") for i in range(count)]


def _url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def _within(fn: Callable[[], Any], deadline_s: float = DEADLINE_S) -> tuple[Any, BaseException | None]:
    """(fn's result, the exception it raised), run on a thread; fails the test if it is still running at the
    deadline (a hang)."""
    out: list = [None, None]

    def run():
        try:
            out[0] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out[1] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(deadline_s)
    assert not t.is_alive(), f"still waiting after {deadline_s:.0f} s: the call hangs"
    return out[0], out[1]


FAST = dict(http_timeout_s=1.0, min_tokens_per_s=1000.0)
"""Timeouts of a test: 1 s for short calls, 1 s + 5 / 1000 s for a 5-token /generate."""


def test_timeouts_follow_the_request_and_are_validated():
    c = ClientConfig()
    assert c.generate_timeout_s(20480) == 60.0 + 2048.0  # the production response length: ~35 min, not 1 h each
    assert c.timeout_for("/update_weights_from_tensor") == c.timeout_for("/end_weight_update") == 600.0
    assert c.timeout_for("/abort_request") == c.timeout_for("/health") == c.timeout_for("/flush_cache") == 60.0
    with pytest.raises(ValueError, match="--sglang-http-timeout"):
        ClientConfig(http_timeout_s=0)
    with pytest.raises(ValueError, match="--sglang-min-tokens-per-s"):
        ClientConfig(min_tokens_per_s=-1)
    args = build_parser().parse_args(["--hf-checkpoint", "m", "--prompt-data", "p", "--num-steps", "1",
                                      "--sglang-http-timeout", "5",
                                      "--sglang-min-tokens-per-s", "20"])
    assert (args.sglang_http_timeout, args.sglang_min_tokens_per_s) == (5.0, 20.0)


def test_attaching_to_a_server_that_never_answers_fails_within_the_http_timeout():
    """A socket that accepts TCP connections (the kernel's backlog) and never answers: the engine refuses it at
    attach, naming the URL and --sglang-http-timeout."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"

        def attach_and_generate():
            engine = SGLangEngine(server_urls=[url], client=ClientConfig(**FAST, server_wait_s=2))
            try:
                return engine.generate(_reqs(1, n=1))
            finally:
                engine.shutdown()

        _, err = _within(attach_and_generate)
    assert isinstance(err, UserError), err
    assert url in str(err) and "--sglang-http-timeout" in str(err)


class _NotFound(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_error(404, "File not found")

    do_POST = do_GET

    def log_message(self, *args):
        pass


def test_attaching_to_a_plain_http_server_is_an_error_naming_url_and_answer():
    web = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        url = _url(web)
        _, err = _within(lambda: SGLangEngine(server_urls=[url], client=ClientConfig(**FAST, server_wait_s=2)))
        assert isinstance(err, UserError), err
        assert f"--sglang-server-urls {url} is not an SGLang server: GET /health answered 404" in str(err)
        # the same page as a router in front of real servers
        fake, state = serve()
        try:
            _, err = _within(lambda: SGLangEngine(server_urls=[_url(fake)], router_url=url,
                                                  client=ClientConfig(**FAST)))
            assert isinstance(err, UserError) and f"--sglang-router-url {url}" in str(err) and "404" in str(err)
        finally:
            kill(fake, state)
    finally:
        web.shutdown()
        web.server_close()


def test_attach_refused_for_a_missing_api_key_names_the_flag():
    fake, state = serve(api_key="s3cret")  # /health is open; /server_info wants the key, as SGLang's middleware
    try:
        with pytest.raises(UserError, match=r"refused GET /server_info \(401\).*--sglang-api-key-file"):
            SGLangEngine(server_urls=[_url(fake)], client=ClientConfig(**FAST))
    finally:
        kill(fake, state)


def test_a_server_that_hangs_mid_run_is_lost_and_its_samples_redone_elsewhere():
    """Server 0 starts hanging after attach (requests read, never answered): its /generate calls time out after
    1 s + 5 / 1000 s, it is taken out of rotation and recovered, and every sample is served by server 1."""
    fakes = [serve() for _ in range(2)]
    engine = SGLangEngine(server_urls=[_url(s) for s, _ in fakes],
                          client=ClientConfig(**FAST, server_wait_s=30, max_concurrency=4))
    try:
        fakes[0][1].frozen = True
        groups, err = _within(lambda: engine.generate(_reqs(4, n=2)))
        assert err is None, err
        assert sorted(g[0].request_id for g in groups) == [f"p{i}" for i in range(4)]
        assert all(s.finish_reason == "length" and len(s.response_ids) == 5 for g in groups for s in g)
        metrics = engine.take_metrics()
        assert metrics["rollout/servers_lost"] == 1 and metrics["rollout/retried_requests"] >= 1
    finally:
        engine.shutdown()
        for fake in fakes:
            kill(*fake)


GENERATE_LIMIT = r"1\.005 s \(--sglang-http-timeout 1 \+ 5 new tokens / --sglang-min-tokens-per-s 1000\)"
"""How a FAST engine names a 5-token /generate's timeout and the flags it comes from."""


def test_the_only_server_hanging_stops_the_run_naming_it():
    """Attached, alone, hung: lost after the /generate timeout, waited for --sglang-server-wait-s (its /health
    times out too), then the run stops with one line (a UserError: `error: ...`, no traceback) naming its URL, the
    /generate timeout and the flags of both waits."""
    fake, state = serve()
    url = _url(fake)
    engine = SGLangEngine(server_urls=[url], client=ClientConfig(**FAST, server_wait_s=1.0))
    try:
        state.frozen = True
        _, err = _within(lambda: engine.generate(_reqs(2, n=1)))
        assert isinstance(err, UserError), repr(err)
        assert re.fullmatch(rf"attached SGLang server {url} did not answer /health for 1 s \(--sglang-server-wait-s\) "
                            rf"after it was lost \({url} did not answer /generate within {GENERATE_LIMIT}\); restart "
                            r"it with the same model and port, or drop it from --sglang-server-urls", str(err)), err
    finally:
        engine.shutdown()
        kill(fake, state)


def test_a_generate_that_hangs_on_a_live_server_stops_the_run_in_one_line():
    """/generate hangs while /health answers (a wedged scheduler behind a live HTTP front): each try times out, the
    server counts as lost and is back at once, and after 1 + max_retries tries the run stops with one line naming
    the sample, the server, the timeout and its flags (it was a ServerDied whose text, httpx's ReadTimeout's, was
    empty, raised with the chain of the timeout behind it)."""
    fake, state = serve()
    url = _url(fake)
    engine = SGLangEngine(server_urls=[url], client=ClientConfig(**FAST, max_retries=1, server_wait_s=30))
    try:
        state.hang_generate = True
        _, err = _within(lambda: engine.generate(_reqs(1, n=1)))
        assert isinstance(err, UserError), repr(err)
        assert re.fullmatch(rf"SGLang sample p0::0 failed 2 tries, the last: {url} did not answer /generate within "
                            rf"{GENERATE_LIMIT}; raise those flags if the servers are only slow, else restart them",
                            str(err)), err
        assert state.calls["/generate"] == 2
    finally:
        engine.shutdown()
        kill(fake, state)


def test_a_dead_router_is_logged_once_and_counted(capsys):
    """The router dies while its servers serve: every sample is served directly, each counted once in
    rollout/router_fallbacks (none as a retry or a lost server), and one warning names the router."""
    router, router_state = serve()
    fakes = [serve() for _ in range(2)]
    engine = SGLangEngine(server_urls=[_url(s) for s, _ in fakes], router_url=_url(router),
                          client=ClientConfig(**FAST, max_concurrency=4))
    try:
        kill(router, router_state)
        for _ in range(2):  # the second round skips the router without trying it
            groups, err = _within(lambda: engine.generate(_reqs(4, n=2)))
            assert err is None and all(len(s.response_ids) == 5 for g in groups for s in g), err
            metrics = engine.take_metrics()
            assert metrics["rollout/router_fallbacks"] == 8
            assert metrics["rollout/retried_requests"] == metrics["rollout/servers_lost"] == 0
        assert sum(len(st.rids) for _, st in fakes) == 16
        warnings = [line for line in capsys.readouterr().err.splitlines() if "router" in line]
        assert len(warnings) == 1 and _url(router) in warnings[0] and "rollout/router_fallbacks" in warnings[0]
    finally:
        engine.shutdown()
        for fake in fakes:
            kill(*fake)


def test_a_dead_router_is_tried_again_after_60_s(monkeypatch):
    """docs/FAULT_TOLERANCE.md's "the router is tried again every 60 s", on an injected clock (the engine module's
    time.monotonic, held still by the test; no wall-clock wait): after the router failed, first tries skip it while
    59.9 s pass (it is back by then, and gets nothing), and go through it again once 60.1 s have."""
    import time

    from megatron_dapo.rollout.sglang import engine as engine_module

    now = [1000.0]

    class _Clock:
        """`time` for the engine module, with a monotonic clock that moves only when the test moves it."""

        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        def monotonic(self) -> float:
            return now[0]

    monkeypatch.setattr(engine_module, "time", _Clock())
    assert engine_module.ROUTER_RETRY_S == 60.0
    router, router_state = serve()
    port = router.server_address[1]
    fakes = [serve() for _ in range(2)]
    engine = SGLangEngine(server_urls=[_url(s) for s, _ in fakes], router_url=_url(router),
                          client=ClientConfig(**FAST, max_concurrency=4))
    try:
        kill(router, router_state)
        for advance, through_router in ((0.0, False), (59.9, False), (0.2, True)):
            now[0] += advance
            groups, err = _within(lambda: engine.generate(_reqs(2, n=2)))
            assert err is None and all(len(s.response_ids) == 5 for g in groups for s in g), err
            metrics = engine.take_metrics()
            assert metrics["rollout/router_fallbacks"] == (0 if through_router else 4), (advance, metrics)
            if advance == 0.0:
                router, router_state = serve(port=port)  # back at once: only the clock keeps it out
        assert router_state.calls.get("/generate", 0) == 4
    finally:
        engine.shutdown()
        kill(router, router_state)
        for fake in fakes:
            kill(*fake)
