"""A small stand-in for an SGLang server's HTTP API, for client tests without SGLang.

It follows SGLang 0.5.23's wire format (see shared/notes/sglang-on-cpu.md) with a deterministic "model":
response token k of a prompt is fake_token(prompt, seed, k), its log-prob fake_logprob(token); weight
updates are stored and reported at /stats. /server_info reports tp_size and dp_size (serve(tp_size=...)); the
distributed path is real: /init_weights_update_group makes one gloo member per fake TP rank join the trainer's
group as rank_offset + tp_rank (as SGLang, recorded in /stats "group_inits"), and /update_weights_from_distributed
receives the flattened bucket on every one of them (one collective request at a time per server, as SGLang's
scheduler; /stats "received" says which group brought which tensors). Bound to 127.0.0.1 and self-stopping after
--lifetime seconds.
Run as a script (it accepts --api-key, or a --config YAML with api-key, and ignores sglang.launch_server's
other flags) or in a thread via serve(); kill() makes a threaded one die like a real server (in-flight requests
get their connection dropped, new ones are refused) and serve(port=...) brings one back on the same port with
fresh state; `state.frozen = True` makes it hang (every request read, none answered) until kill(), and
`state.hang_generate = True` (--hang-generate) only its /generate; --die-at-group-init makes the process exit when
/init_weights_update_group arrives (a server lost after the update began, before its group formed);
`state.stuck_receive = True` hangs only its weight receive (/health answers 503), as a server hung mid-update.
Abort tests: a rid in `state.held` stops after its first token (listed in `state.holding` meanwhile) until it is
aborted or taken out of `held`, so a test knows what is in flight when it aborts; every /abort_request body is kept
in `state.abort_bodies`, in order.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def fake_token(prompt: list[int], seed: int, k: int) -> int:
    return (sum(prompt) + 7 * k + seed) % 90 + 2


def fake_logprob(token: int) -> float:
    return -0.05 - (token % 10) / 10


class ServerKilled(ConnectionAbortedError):
    """Raised in a handler of a killed fake server: the connection drops without a response."""


class FakeState:
    def __init__(self, token_delay_s: float = 0.0, api_key: str | None = None, tp_size: int = 1,
                 dp_size: int = 1):
        self.token_delay_s = token_delay_s
        self.tp_size, self.dp_size = tp_size, dp_size
        self.tensor_payloads: list[int] = []  # payload count of each /update_weights_from_tensor
        self.group_inits: list[dict] = []  # /init_weights_update_group bodies, in order
        self.groups: dict[str, list] = {}  # group name -> one gloo group per fake TP rank
        self.api_key = api_key
        self.lock = threading.Lock()
        self.aborted: set[str] = set()
        self.abort_epoch = 0  # /abort_request {abort_all} aborts what is in flight at that moment
        self.abort_bodies: list[dict] = []  # every /abort_request body, in order
        self.held: set[str] = set()  # rids whose /generate waits after its first token until aborted or let go
        self.holding: set[str] = set()  # held rids waiting now
        self.dead = False
        self.frozen = False  # a hung server: connections are accepted, requests read, nothing is answered
        self.hang_generate = False  # only /generate hangs (a wedged scheduler, a live HTTP front): --hang-generate
        self.authorizations: list[str | None] = []
        self.paused = threading.Event()
        self.in_update = False
        self.weights: dict[str, list] = {}
        self.version = "default"
        # also answer meta_info.weight_versions (SGLang 0.5.23's per-token version spans); off: older servers
        self.weight_versions = False
        self.calls: dict[str, int] = {}
        self.rids: list[str] = []
        self.served: list[tuple[str, str]] = []  # (rid, the weight version it was generated with), in arrival order
        self.received: list[tuple[str, list[str], str]] = []  # (group, tensor names, version) of each bucket
        # SGLang's scheduler runs one request at a time: a group init or a receive blocks the server's others
        self.collective = threading.Lock()
        self.receive_delay_s = 0.0  # a slow receive (a bucket taking time to load), --receive-delay
        self.die_at_group_init = False  # the process exits when /init_weights_update_group arrives: --die-at-group-init
        self.group_timeout_s = 30.0  # how long a member waits in a weight-update group's rendezvous
        self.on_death: Callable[[], None] | None = None  # serve(): how this threaded server dies (kill, threaded)
        # a hung server: /update_weights_from_distributed never enters the broadcast and /health answers 503 (SGLang's
        # /health when its scheduler does not answer), until kill()
        self.stuck_receive = False
        self.released: set[str] = set()  # memory tags released (/release_memory_occupation)
        self.memory_calls: list[tuple[str, list[str]]] = []


def _generate(state: FakeState, body: dict) -> tuple[int, dict]:
    rid, prompt, params = body["rid"], body["input_ids"], body["sampling_params"]
    while state.hang_generate and not state.dead:
        time.sleep(0.05)
    if state.dead:
        raise ServerKilled(rid)
    if not body.get("return_logprob") or not isinstance(prompt, list):
        return 400, {"error": "expected input_ids and return_logprob"}
    if state.released & {"weights", "kv_cache"}:
        return 400, {"error": f"memory released ({sorted(state.released)}): /resume_memory_occupation first"}
    with state.lock:
        state.rids.append(rid)
        state.served.append((rid, state.version))
    seed = params.get("sampling_seed", 0)
    epoch = state.abort_epoch
    stops = set(params.get("stop_token_ids", []))
    tokens, reason = [], {"type": "length", "length": params["max_new_tokens"]}
    labels: list[str] = []  # the weight version each token was generated with
    for k in range(params["max_new_tokens"]):
        if k == 1:
            _hold(state, rid, epoch)
        while state.paused.is_set():
            time.sleep(0.005)
        if state.dead:
            raise ServerKilled(rid)
        if rid in state.aborted or state.abort_epoch != epoch:
            reason = {"type": "abort", "message": "Abort before prefill" if not tokens else "aborted"}
            break
        time.sleep(state.token_delay_s)
        tok = fake_token(prompt, seed, k)
        tokens.append(tok)
        labels.append(state.version)
        if tok in stops:
            reason = {"type": "stop", "matched": tok}
            break
    meta = {
        "id": rid, "finish_reason": reason, "prompt_tokens": len(prompt), "completion_tokens": len(tokens),
        "weight_version": state.version,
        "output_token_logprobs": [[fake_logprob(t), t, None] for t in tokens],
    }
    if state.weight_versions:
        meta["weight_versions"] = version_spans(labels, state.version)
        meta["weight_version"] = meta["weight_versions"][-1]["version"]  # as SGLang: the last span's
    return 200, {"output_ids": tokens, "meta_info": meta}


def version_spans(labels: list[str], current: str) -> list[dict]:
    """SGLang's meta_info.weight_versions for tokens generated with weight versions `labels`: half-open
    [start, end) spans of equal versions; an empty response has one span [0, 0) of the `current` version."""
    spans = [{"version": current, "start": 0, "end": 0}] if not labels else []
    for k, label in enumerate(labels):
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = k + 1
        else:
            spans.append({"version": label, "start": k, "end": k + 1})
    return spans


def _hold(state: FakeState, rid: str, epoch: int) -> None:
    """Blocks a /generate of a rid in `state.held` (listed in `state.holding` meanwhile) until the rid is aborted
    (by rid, or an abort-all since the request came in: `epoch`), taken out of `held`, or the server dies."""
    if rid not in state.held:
        return
    with state.lock:
        state.holding.add(rid)
    while rid in state.held and rid not in state.aborted and state.abort_epoch == epoch and not state.dead:
        time.sleep(0.005)
    with state.lock:
        state.holding.discard(rid)


def _load_tensors(state: FakeState, named) -> None:
    for name, tensor in named:
        state.weights[name] = tensor.clone().tolist()


def _on_ranks(state: FakeState, fn, timeout_s: float = 60.0) -> list:
    """Runs fn(tp_rank) on one thread per fake TP rank (collectives need them all at once); their results."""
    out: list = [None] * state.tp_size

    def run(r):
        try:
            out[r] = fn(r)
        except Exception as e:  # noqa: BLE001 - reported to the client as success: false
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(state.tp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return out


def _init_group(state: FakeState, body: dict) -> tuple[int, dict]:
    from datetime import timedelta

    import torch.distributed as dist

    with state.lock:
        state.group_inits.append(dict(body))
    name, world, timeout = body["group_name"], body["world_size"], timedelta(seconds=state.group_timeout_s)
    url = f"tcp://{body['master_address']}:{body['master_port']}"

    def join(tp_rank):  # what torch's _new_process_group_helper builds for a gloo group named `name`
        rank = body["rank_offset"] + tp_rank
        store, _, _ = next(dist.rendezvous(url, rank, world, timeout=timeout))
        prefix = dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store))
        return dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefix), rank, world, timeout=timeout)

    with state.collective:
        groups = _on_ranks(state, join)
    errors = [g for g in groups if g is None or isinstance(g, Exception)]  # None: still waiting at the timeout
    if errors:
        return 200, {"success": False, "message": f"group {name} did not form: {errors[0]!r}"}
    state.groups[name] = groups
    return 200, {"success": True, "message": ""}


def _receive(state: FakeState, body: dict) -> tuple[int, dict]:
    import torch
    import torch.distributed as dist

    if not state.in_update:
        return 400, {"success": False, "message": "call /begin_weight_update first"}
    groups = state.groups.get(body["group_name"])
    if groups is None:
        return 400, {"success": False, "message": f"no group {body['group_name']}"}
    dtype = getattr(torch, body["dtypes"][0])
    numels = [int(torch.Size(s).numel()) for s in body["shapes"]]
    while state.stuck_receive and not state.dead:
        time.sleep(0.05)
    if state.dead:
        raise ServerKilled("/update_weights_from_distributed")

    def recv(tp_rank):
        flat = torch.empty(sum(numels), dtype=dtype)
        groups[tp_rank].broadcast([flat.view(torch.uint8)], dist.BroadcastOptions()).wait()
        return flat

    with state.collective:
        flats = _on_ranks(state, recv)
        time.sleep(state.receive_delay_s)
    bad = [f for f in flats if f is None or isinstance(f, Exception)]
    if bad:
        return 200, {"success": False, "message": f"broadcast not received: {bad[0]!r}"}
    offsets = [sum(numels[:k]) for k in range(len(numels))]
    _load_tensors(state, [(n, flats[0][o:o + c].view(s))
                          for n, o, c, s in zip(body["names"], offsets, numels, body["shapes"], strict=True)])
    state.version = body.get("weight_version") or state.version
    with state.lock:
        state.received.append((body["group_name"], list(body["names"]), state.version))
    return 200, {"success": True, "message": "ok"}


def _handle(state: FakeState, path: str, body: dict) -> tuple[int, dict]:
    with state.lock:
        state.calls[path] = state.calls.get(path, 0) + 1
    if path == "/generate":
        return _generate(state, body)
    if path == "/abort_request":
        with state.lock:
            state.abort_bodies.append(dict(body))
        if body.get("abort_all"):
            state.abort_epoch += 1
        else:
            state.aborted.add(body["rid"])
        return 200, {}
    if path == "/pause_generation":
        state.paused.set()
        return 200, {}
    if path == "/continue_generation":
        state.paused.clear()
        return 200, {}
    if path == "/flush_cache":
        return 200, {}
    if path == "/model_info":
        return 200, {"weight_version": state.version}
    if path == "/server_info":
        return 200, {"tp_size": state.tp_size, "dp_size": state.dp_size}
    if path == "/init_weights_update_group":
        if state.die_at_group_init:  # the server dies as the call arrives (SIGKILL-like)
            if state.on_death is None:  # run as a script (--die-at-group-init): the process
                os._exit(1)
            state.on_death()  # in a thread (serve()): kill() from another thread, this connection dropped
            raise ServerKilled(path)
        return _init_group(state, body)
    if path == "/update_weights_from_distributed":
        return _receive(state, body)
    if path == "/destroy_weights_update_group":
        if state.groups.pop(body["group_name"], None) is None:
            return 400, {"success": False, "message": f"no group {body['group_name']}"}
        return 200, {"success": True, "message": ""}
    if path == "/begin_weight_update":
        state.in_update = True
        return 200, {"success": True, "message": ""}
    if path == "/end_weight_update":
        state.in_update = False
        return 200, {"success": True, "message": ""}
    if path in ("/release_memory_occupation", "/resume_memory_occupation"):
        tags = set(body.get("tags") or ("weights", "kv_cache", "cuda_graph"))
        with state.lock:
            state.memory_calls.append((path.strip("/").split("_")[0], sorted(tags)))
            state.released = state.released | tags if path.startswith("/release") else state.released - tags
        return 200, {}
    if path == "/update_weights_from_tensor":
        if not state.in_update:  # as SGLang 0.5.23
            return 400, {"success": False, "message": "call /begin_weight_update first"}
        if "weights" in state.released:  # on a GPU the weights' memory is gone until resumed
            return 400, {"success": False, "message": "weights released: /resume_memory_occupation first"}
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - tensor reductions

        payloads = body["serialized_named_tensors"]
        state.tensor_payloads.append(len(payloads))  # one per TP rank, as SGLang expects
        named = ForkingPickler.loads(base64.b64decode(payloads[0]))
        for other in payloads[1:]:  # one per TP rank: colocated pushes send each rank's own copy
            theirs = ForkingPickler.loads(base64.b64decode(other))
            if [n for n, _ in theirs] != [n for n, _ in named] or \
                    any(not a.equal(b) for (_, a), (_, b) in zip(named, theirs, strict=True)):
                return 400, {"success": False, "message": "the TP ranks' payloads differ"}
        _load_tensors(state, named)
        state.version = body.get("weight_version") or state.version
        return 200, {"success": True, "message": "ok"}
    if path == "/update_weights_from_disk":
        from safetensors.torch import load_file

        for f in sorted(os.listdir(body["model_path"])):
            if f.endswith(".safetensors"):
                _load_tensors(state, load_file(os.path.join(body["model_path"], f)).items())
        state.version = body.get("weight_version") or state.version
        return 200, {"success": True, "message": "ok"}
    if path == "/stats":
        with state.lock:
            return 200, {"calls": dict(state.calls), "rids": list(state.rids), "version": state.version,
                         "weights": state.weights, "aborted": sorted(state.aborted),
                         "abort_bodies": list(state.abort_bodies),
                         "authorizations": list(state.authorizations), "group_inits": list(state.group_inits),
                         "tensor_payloads": list(state.tensor_payloads),
                    "received": list(state.received), "memory_calls": list(state.memory_calls)}
    return 404, {"error": f"no route {path}"}


def make_server(port: int, state: FakeState) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            auth = self.headers.get("Authorization")
            with state.lock:
                state.authorizations.append(auth)
            while state.frozen and not state.dead:
                time.sleep(0.05)
            if state.dead:
                raise ServerKilled(self.path)
            if state.api_key is None or self.path == "/health" or auth == f"Bearer {state.api_key}":
                return True
            self._reply(401, {"error": "Unauthorized"})  # as SGLang's api-key middleware
            return False

        def do_GET(self):
            if not self._authorized():
                return
            if self.path == "/health":
                self._reply(503 if state.stuck_receive else 200, {})
            else:
                self._reply(*_handle(state, self.path, {}))

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if self._authorized():
                self._reply(*_handle(state, self.path, body))

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass  # a killed server drops connections; no traceback

    server = Server(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    return server


def serve(port: int = 0, token_delay_s: float = 0.0, api_key: str | None = None, tp_size: int = 1,
          dp_size: int = 1) -> tuple[ThreadingHTTPServer, FakeState]:
    """Starts a fake server on a thread; port 0 picks a free one (server.server_address[1])."""
    state = FakeState(token_delay_s, api_key, tp_size, dp_size)
    server = make_server(port, state)
    state.on_death = lambda: threading.Thread(target=kill, args=(server, state), daemon=True).start()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, state


def kill(server: ThreadingHTTPServer, state: FakeState) -> None:
    """Dies like a real server: requests in flight lose their connection, new connections are refused."""
    state.dead = True
    server.shutdown()
    server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--lifetime", type=float, default=float(os.environ.get("FAKE_SGLANG_LIFETIME", 120)))
    parser.add_argument("--startup-delay", type=float, default=0.2)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--config", default=None, help="YAML merged into the arguments, as SGLang's (api-key only)")
    parser.add_argument("--receive-delay", type=float, default=0.0)
    parser.add_argument("--hang-generate", action="store_true", help="/generate never answers; the rest does")
    parser.add_argument("--die-at-group-init", action="store_true",
                        help="the process exits when /init_weights_update_group arrives (lost before a group forms)")
    args, _ = parser.parse_known_args()
    time.sleep(args.startup_delay)  # a real server is not healthy at once either
    threading.Timer(args.lifetime, lambda: os._exit(0)).start()  # never outlives a test run
    if args.config is not None and args.api_key is None:
        import yaml

        with open(args.config) as f:
            args.api_key = yaml.safe_load(f).get("api-key")
    state = FakeState(api_key=args.api_key)
    state.receive_delay_s = args.receive_delay
    state.hang_generate = args.hang_generate
    state.die_at_group_init = args.die_at_group_init
    make_server(args.port, state).serve_forever()


if __name__ == "__main__":
    main()
