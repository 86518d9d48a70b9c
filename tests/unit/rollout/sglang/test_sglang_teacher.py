"""The SGLang teacher's client (rollout/sglang/teacher.py) against an in-memory SGLang (httpx.MockTransport) whose
tokenizer and "model" the test chooses: a server with the student's tokenizer passes the check and reports its model,
one whose tokenizer maps an id to other text or splits text otherwise is refused naming both tokenizers, as are
servers of two models and a refused key; the scorer's log-probs are the server's, in sample order; the flags refuse
what cannot run. The real server: tests/sglang/test_trainer_sglang_teacher.py."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import torch

from megatron_dapo.actor import TrainSample
from megatron_dapo.arguments import build_parser
from megatron_dapo.data.synthetic import build_char_tokenizer
from megatron_dapo.errors import UserError
from megatron_dapo.rollout.sglang.teacher import (
    PROBE_TEXT,
    SGLangTeacher,
    TeacherServerConfig,
    check_teacher,
)

KEY = "teacher-k3y-5ecret"


def teacher_logprob(prefix: list[int], token: int) -> float:
    """The fake teacher's log pi(token | prefix): a deterministic function of both."""
    return -0.01 * ((sum(prefix) * 31 + token * 7) % 97) - 0.05


class FakeTeacher:
    """An SGLang server's /model_info, /detokenize, /tokenize and scoring /generate over `tokenizer`; records every
    request's path and Authorization header."""

    def __init__(self, tokenizer, model: str = "/models/teacher", *, key: str | None = KEY, encode=None,
                 tokenizer_path: str | None = None):
        self.tokenizer, self.model, self.key = tokenizer, model, key
        self.tokenizer_path = tokenizer_path  # set: started with --skip-tokenizer-init, its tokenizer there
        self.encode = encode or (lambda text: tokenizer.encode(text, add_special_tokens=False))
        self.calls: list[tuple[str, str | None]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        auth = request.headers.get("authorization")
        self.calls.append((request.url.path, auth))
        if self.key is not None and auth != f"Bearer {self.key}":
            return httpx.Response(401, json={"error": "Unauthorized"})
        path = request.url.path
        if path == "/model_info":
            return httpx.Response(200, json={"model_path": self.model,
                                             "tokenizer_path": self.tokenizer_path or self.model + "/tok"})
        if path == "/server_info":
            return httpx.Response(200, json={"skip_tokenizer_init": self.tokenizer_path is not None})
        if self.tokenizer_path is not None and path in ("/detokenize", "/tokenize"):
            return httpx.Response(400, json={"message": "'NoneType' object has no attribute 'decode'"})
        body = json.loads(request.content)
        if path == "/detokenize":
            texts = [self.tokenizer.decode(ids, skip_special_tokens=body["skip_special_tokens"])
                     for ids in body["tokens"]]
            return httpx.Response(200, json={"text": texts})
        if path == "/tokenize":
            ids = self.encode(body["prompt"])
            return httpx.Response(200, json={"tokens": ids, "count": len(ids), "max_model_len": 512})
        if path == "/generate":
            ids, start = body["input_ids"], body["logprob_start_len"]
            entries = [[None if t == start else teacher_logprob(ids[:t], ids[t]), ids[t], None]
                       for t in range(start, len(ids))]
            return httpx.Response(200, json={"text": "", "meta_info": {"input_token_logprobs": entries}})
        return httpx.Response(404)


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return build_char_tokenizer(str(tmp_path_factory.mktemp("student")))


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "teacher.key"
    path.write_text(KEY + "\n")
    os.chmod(path, 0o600)
    return str(path)


def _cfg(key_file, *urls: str) -> TeacherServerConfig:
    return TeacherServerConfig(urls=urls or ("http://teacher:30000",), api_key_file=key_file)


def test_a_server_with_the_students_tokenizer_passes_and_reports_its_model(student, key_file):
    fake = FakeTeacher(student)
    assert check_teacher(_cfg(key_file), student, transport=httpx.MockTransport(fake)) == "/models/teacher"
    paths = [p for p, _ in fake.calls]
    assert paths[0] == "/model_info" and paths[-1] == "/tokenize" and "/detokenize" in paths
    assert {auth for _, auth in fake.calls} == {f"Bearer {KEY}"}


def _swapped_tokenizer(path):
    """The char tokenizer saved at `path` with two characters' ids swapped: same size, other text."""
    from transformers import AutoTokenizer

    build_char_tokenizer(str(path))
    spec = json.loads((path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return AutoTokenizer.from_pretrained(str(path))


def test_a_teacher_that_decodes_an_id_to_other_text_is_refused_naming_both(student, key_file, tmp_path):
    other = _swapped_tokenizer(tmp_path / "other")
    with pytest.raises(UserError, match=r"--teacher-url: the teacher's tokenizer \(http://teacher:30000, serving "
                                        r"/models/teacher with the tokenizer /models/teacher/tok\) is not the "
                                        r"student's \(.*student.*, 80 tokens\): id 10 is"):
        check_teacher(_cfg(key_file), student, transport=httpx.MockTransport(FakeTeacher(other)))


def test_a_teacher_that_splits_text_otherwise_is_refused(student, key_file):
    def split_otherwise(text):  # every id decodes alike, but the probe text comes out one token short
        return student.encode(text, add_special_tokens=False)[:-1]

    fake = FakeTeacher(student, encode=split_otherwise)
    want = len(student.encode(PROBE_TEXT, add_special_tokens=False))
    with pytest.raises(UserError, match=rf"splits text differently .* a probe text is {want - 1} tokens to the "
                                        rf"teacher and {want} to the student"):
        check_teacher(_cfg(key_file), student, transport=httpx.MockTransport(fake))


def test_a_server_without_its_tokenizer_is_checked_by_its_files(student, key_file, tmp_path):
    """--skip-tokenizer-init: /detokenize cannot answer; the tokenizer directory /model_info names is compared whole
    where this node reads it, or the run is refused saying how to start the teacher."""
    build_char_tokenizer(str(tmp_path / "same"))
    fake = FakeTeacher(student, tokenizer_path=str(tmp_path / "same"))
    assert check_teacher(_cfg(key_file), student, transport=httpx.MockTransport(fake)) == "/models/teacher"
    assert "/detokenize" not in [p for p, _ in fake.calls]
    _swapped_tokenizer(tmp_path / "other")
    with pytest.raises(UserError, match=r"--teacher-url http://teacher:30000 \(serving /models/teacher\): its "
                                        r"tokenizer .* 2 tokens differ"):
        check_teacher(_cfg(key_file), student,
                      transport=httpx.MockTransport(FakeTeacher(student, tokenizer_path=str(tmp_path / "other"))))
    with pytest.raises(UserError, match=r"started with --skip-tokenizer-init, .* path /elsewhere/tok is not a "
                                        r"directory on this node: start the teacher without --skip-tokenizer-init"):
        check_teacher(_cfg(key_file), student,
                      transport=httpx.MockTransport(FakeTeacher(student, tokenizer_path="/elsewhere/tok")))


def test_servers_of_two_models_a_refused_key_and_a_bad_key_file_are_refused(student, key_file, tmp_path):
    one, two = FakeTeacher(student, "/models/a"), FakeTeacher(student, "/models/b")

    def route(request: httpx.Request) -> httpx.Response:
        return (one if request.url.host == "a" else two)(request)

    with pytest.raises(UserError, match="http://a:1 serves /models/a and http://b:1 serves /models/b"):
        check_teacher(_cfg(key_file, "http://a:1", "http://b:1"), student, transport=httpx.MockTransport(route))
    with pytest.raises(UserError, match=r"--teacher-url http://teacher:30000: /model_info refused the call \(401\): "
                                        r"put the API key .* in --teacher-api-key-file"):
        check_teacher(_cfg(None), student, transport=httpx.MockTransport(FakeTeacher(student)))
    loose = tmp_path / "loose.key"
    loose.write_text(KEY)
    os.chmod(loose, 0o644)
    with pytest.raises(UserError, match=rf"--teacher-api-key-file {loose}: mode 0644"):
        check_teacher(_cfg(str(loose)), student, transport=httpx.MockTransport(FakeTeacher(student)))


def test_the_teacher_scores_every_sample_in_order(key_file):
    fake = FakeTeacher(None)
    samples = [TrainSample(tokens=[3 + i] * p + list(range(10, 10 + r)), prompt_len=p)
               for i, (p, r) in enumerate([(1, 1), (4, 6), (2, 9)])]
    teacher = SGLangTeacher(_cfg(key_file, "http://a:1", "http://b:1"), transport=httpx.MockTransport(fake))
    try:
        got = teacher.compute_log_probs(samples)
    finally:
        teacher.close()
    for s, lp in zip(samples, got, strict=True):
        want = [teacher_logprob(s.tokens[:t], s.tokens[t]) for t in range(s.prompt_len, len(s.tokens))]
        assert lp.dtype == torch.float32 and lp.tolist() == pytest.approx(want, rel=1e-6)
    assert [p for p, _ in fake.calls] == ["/generate"] * 3


def test_the_flags_build_the_config_and_refuse_what_cannot_run(key_file):
    from megatron_dapo.startup import build_configs, checkpoint_config

    def args(*flags):
        return build_parser().parse_args(["--hf-checkpoint", "x", "--prompt-data", "y", "--num-steps", "2", *flags])

    a = args("--teacher-url", "http://t:1", "http://t:2", "--teacher-api-key-file", key_file, "--distill-coef", "0.5",
             "--teacher-max-concurrency", "8")
    assert build_configs(a)[2].distill.coef == 0.5
    assert checkpoint_config(a).teacher_server == TeacherServerConfig(urls=("http://t:1", "http://t:2"),
                                                                      api_key_file=key_file, max_concurrency=8)
    with pytest.raises(UserError, match="--teacher-load and --teacher-url are two places for one teacher"):
        build_configs(args("--teacher-url", "http://t:1", "--teacher-load", "t", "--distill-coef", "1"))
    with pytest.raises(UserError, match="--teacher-api-key-file need a teacher"):
        build_configs(args("--teacher-api-key-file", key_file))
    with pytest.raises(UserError, match="--teacher-url t:1: not an http:// or https:// URL"):
        checkpoint_config(args("--teacher-url", "t:1", "--distill-coef", "1"))
    with pytest.raises(UserError, match="--teacher-max-concurrency must be >= 1, got 0"):
        checkpoint_config(args("--teacher-url", "http://t:1", "--teacher-max-concurrency", "0"))


def test_a_resume_against_another_served_model_or_a_local_teacher_is_refused():
    """The checkpoint records the served teacher as the model its servers report (actor/reference.py TeacherSource,
    kind "sglang"): the same model behind other URLs resumes, another model or an in-process teacher does not."""
    from megatron_dapo.actor.reference import TeacherSource

    saved = TeacherSource(kind="sglang", path="/models/teacher", flag="http://a:1").state_dict()
    TeacherSource(kind="sglang", path="/models/teacher", flag="http://b:2 http://c:3").check_state(saved)
    with pytest.raises(UserError, match=r"--teacher-url: the checkpoint was trained against sglang /models/teacher "
                                        r"\(--teacher-url http://a:1\), this run would use sglang /models/other"):
        TeacherSource(kind="sglang", path="/models/other", flag="http://a:1").check_state(saved)
    with pytest.raises(UserError, match=r"this run would use hf /models/teacher \(--teacher-load /models/teacher\)"):
        TeacherSource(kind="hf", path="/models/teacher", flag="/models/teacher").check_state(saved)


def test_a_lost_server_is_retried_on_the_next_and_a_teacher_gone_for_good_fails_naming_it(key_file):
    """A request whose server refuses the connection or answers 5xx goes to the next server after a wait; when every
    try fails, the step fails with the last server's error (the run then resumes from its checkpoint)."""
    from megatron_dapo.rollout.sglang.scoring import SGLangScorer

    fake = FakeTeacher(None, key=None)
    calls: list[str] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.host)
        if request.url.host == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.host == "busy":
            return httpx.Response(503, text="restarting")
        return fake(request)

    sample = TrainSample(tokens=[3, 4, 10, 11, 12], prompt_len=2)
    scorer = SGLangScorer(["http://down:1", "http://busy:1", "http://up:1"], transport=httpx.MockTransport(flaky),
                          retry_delays_s=(0.0, 0.0, 0.0))
    try:
        (lp,) = scorer.compute_log_probs([sample])
        assert calls == ["down", "busy", "up"]
        assert lp.tolist() == pytest.approx([teacher_logprob(sample.tokens[:t], sample.tokens[t]) for t in (2, 3, 4)])
    finally:
        scorer.close()
    gone = SGLangScorer(["http://down:1", "http://busy:1"], transport=httpx.MockTransport(flaky),
                        retry_delays_s=(0.0, 0.0))
    try:
        with pytest.raises(RuntimeError, match=r"did not score a sample in 3 tries .* the last, "
                                               r"http://down:1/generate: ConnectError"):
            gone.compute_log_probs([sample])
    finally:
        gone.close()
