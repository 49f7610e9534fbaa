"""The checks a request body passes before it reaches the model (`serving.api`): a JSON body's
repeated keys and unknown fields are refused in time linear in its size, off the event loop, and
only where FastAPI reads the body as JSON; the rest is FastAPI's own answer. Against a minimal
app (`fastapi.testclient`) and a real uvicorn server (in this process, over the tiny run's
bundle, nothing compiled: these tests ask no answers)."""

import concurrent.futures
import json
import math
import shutil
import threading
import time

import fastapi
import httpx
import pytest
from fastapi.testclient import TestClient
from hostile_server_test import InProcess

from rag_jax.io import bundle
from rag_jax.serving import api
from rag_jax.serving import app as serving

JSON = {"content-type": "application/json"}
REPEATED = b'{"questions": ["a ?"], "questions": ["b ?"]}'


def _keys_body(n: int, repeat: bool = False) -> bytes:
    """A JSON object of `n` distinct keys; with `repeat`, its first key again at the end."""
    pairs = ",".join(f'"k{i}":0' for i in range(n)) + (',"k0":1' if repeat else "")
    return ("{" + pairs + "}").encode()


def _error(response, status: int, *parts: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    for part in parts:
        assert part in error["message"], error
    return error


def _timed(fn):
    """(seconds `fn()` took, what it returned)."""
    start = time.monotonic()
    out = fn()
    return time.monotonic() - start, out


def _best_parse_s(body: bytes, repeats: int) -> float:
    """The least CPU time of this thread over `repeats` parses with the repeated-key check: CPU
    time, not wall time, since on a loaded machine a longer parse is preempted more often (the
    50,000 keys' wall time per byte had come out 5x the 5,000 keys' at load average 10)."""
    best = math.inf
    for _ in range(repeats):
        start = time.thread_time()
        try:
            json.loads(body, object_pairs_hook=api._refuse_duplicates)
        except api._Duplicate:
            pass
        best = min(best, time.thread_time() - start)
    return best


@pytest.mark.parametrize("repeat", [False, True], ids=["distinct", "repeated_last"])
def test_the_repeated_key_check_costs_the_same_per_byte_at_ten_times_the_keys(repeat):
    """It was quadratic (`key in keys[:i]`): an object of 20,000 keys held the event loop for
    seconds. Ten times the keys must cost about ten times as much (quadratic: a hundred)."""
    small, large = _keys_body(5_000, repeat), _keys_body(50_000, repeat)
    # Interleaved, the least of each: a loaded machine slows both sizes alike, not one of them.
    best = [math.inf, math.inf]
    for _ in range(10):
        for i, body in enumerate((small, large)):
            best[i] = min(best[i], _best_parse_s(body, 2 if i == 0 else 1))
    per_byte = [best[0] / len(small), best[1] / len(large)]
    assert per_byte[1] < 4 * per_byte[0], per_byte
    if repeat:
        with pytest.raises(api.ApiError, match="repeats the key 'k0'"):
            api.check_json_body(large, None)


def test_bodies_are_checked_exactly_where_fastapi_reads_them_as_json():
    """`api.is_json` is FastAPI's rule: a body it does not read as JSON (text/plain, which any
    web page may send cross-site) is not parsed by the check either, and gets FastAPI's answer
    (422: not an object); one it reads is refused for a repeated key."""
    app = fastapi.FastAPI()
    app.router.route_class = api.StrictJsonRoute

    @app.exception_handler(api.ApiError)
    async def api_error(request, e):
        return api.error_response(e.status, e.message)

    @app.post("/echo")
    async def echo(body: api.AnswerRequest):
        return {"questions": body.questions}

    client = TestClient(app, raise_server_exceptions=False)
    types = [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/vnd.api+json",
        "text/plain",
        "text/plain; charset=utf-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        "",
    ]
    read = []
    for content_type in types:
        headers = {"content-type": content_type} if content_type else {}
        valid = client.post("/echo", content=b'{"questions": ["a ?"]}', headers=headers)
        repeated = client.post("/echo", content=REPEATED, headers=headers)
        if valid.status_code == 200:  # FastAPI read the body as JSON
            read.append(content_type)
            assert repeated.status_code == 422
            assert "repeats the key 'questions'" in repeated.json()["error"]["message"]
        else:  # bytes, not an object: FastAPI's answer, the same for both bodies
            for response in (valid, repeated):
                assert response.status_code == 422, response.text
                detail = response.json().get("detail", [{}])[0]
                assert detail.get("type") == "model_attributes_type", response.text
    assert read == types[:4]
    assert [t for t in types if api.is_json(t or None)] == read
    assert api.is_json(None, strict=False)  # a route that is not strict reads it as JSON


@pytest.fixture(scope="module")
def servers(tiny_trained_run, tmp_path_factory):
    """{"edits": a server with edits, "read_only": one without} over a copy of the tiny run's
    bundle, at the default limits (a 1 MiB body), ready at once."""
    directory = tmp_path_factory.mktemp("api") / "bundle"
    shutil.copytree(tiny_trained_run[0] / "bundle", directory)
    model = bundle.load(directory)
    made = {}
    try:
        for name, edits in (("edits", True), ("read_only", False)):
            config = serving.ServerConfig(str(directory), allow_edits=edits)
            made[name] = InProcess(model, config, warm_up=False)
            made[name].wait_ready(60)
        yield made
    finally:
        for server in made.values():
            server.stop()


def test_healthz_answers_while_a_big_keys_body_is_checked(servers, monkeypatch):
    """The check ran on the event loop: 20,000 keys sent to /v1/answer held every request,
    `/healthz` included. Held in its parse here, it must not hold `/healthz`."""
    url = servers["edits"].url
    entered, release = threading.Event(), threading.Event()
    calls = []
    check = api._refuse_duplicates

    def held(pairs):
        calls.append(len(pairs))
        entered.set()
        release.wait(60)
        return check(pairs)

    monkeypatch.setattr(api, "_refuse_duplicates", held)
    post = lambda body, **kw: httpx.post(  # noqa: E731
        f"{url}/v1/answer", content=body, timeout=120, **kw
    )
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        posted = pool.submit(post, _keys_body(20_000), headers=JSON)
        try:
            assert entered.wait(60), "the body was never checked"
            health = httpx.get(f"{url}/healthz", timeout=10)  # answered while the parse waits
            assert health.status_code == 200 and health.json()["ready"], health.text
        finally:
            release.set()
        response = posted.result()
    # Unknown fields: the first few named, not one error (and one response line) per key.
    error = _error(response, 422, "does not match its schema")
    assert [d["loc"] for d in error["details"]] == [["body", f"k{i}"] for i in range(10)]
    assert len(response.content) < 4096, len(response.content)
    # Sent as text/plain the body is not parsed, and FastAPI answers: not an object.
    del calls[:]
    plain = post(_keys_body(20_000, repeat=True), headers={"content-type": "text/plain"})
    error = _error(plain, 422, "does not match its schema")
    assert error["details"][0]["type"] == "model_attributes_type" and calls == []


def test_a_repeated_key_is_refused_naming_it_and_after_the_edit_permission(servers):
    edits, read_only = servers["edits"].url, servers["read_only"].url
    response = httpx.post(f"{edits}/v1/answer", content=REPEATED, headers=JSON, timeout=60)
    _error(response, 422, "repeats the key 'questions'")
    near_the_limit = _keys_body(90_000, repeat=True)  # 1 MiB at most (max_body_bytes)
    assert 900_000 < len(near_the_limit) <= 1 << 20
    response = httpx.post(f"{edits}/v1/answer", content=near_the_limit, headers=JSON, timeout=60)
    _error(response, 422, "repeats the key 'k0'")
    body = b'{"text": "a text .", "text": "another ."}'
    put = lambda url: httpx.put(  # noqa: E731
        f"{url}/v1/passages/dup", content=body, headers=JSON, timeout=60
    )
    _error(put(edits), 422, "repeats the key 'text'")
    _error(put(read_only), 403, "--allow_edits")  # the permission first, whatever the body
    assert httpx.get(f"{edits}/v1/passages/dup").status_code == 404


def test_a_megabyte_of_non_strings_is_refused_at_once_naming_the_field(servers):
    """`{"questions": [0, 0, ...]}` under max_body_bytes: pydantic made an error of each of its
    500,000 items (1.9 s), FastAPI a 45 MB response of them (2 s more), all on the event loop,
    `/healthz` waiting. The schema bounds the list at max_batch: refused from its length."""
    url = servers["edits"].url
    body = b'{"questions": [' + b",".join([b"0"] * ((1 << 20) // 2 - 16)) + b"]}"
    assert 1_000_000 < len(body) <= 1 << 20

    def post():
        return httpx.post(f"{url}/v1/answer", content=body, headers=JSON, timeout=60)

    health = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        refusals = pool.submit(lambda: [_timed(post) for _ in range(3)])
        while True:  # at least once, however fast the refusals
            health.append(_timed(lambda: httpx.get(f"{url}/healthz", timeout=60)))
            if refusals.done():
                break
    for seconds, response in refusals.result():
        _error(response, 413, "questions: 524272 items, at most 16")
        assert len(response.content) < 1024, len(response.content)
        assert seconds < 1.0, seconds  # 4 s on a quiet machine before, 17 s at load 10
    assert all(r.status_code == 200 for _, r in health)
    assert max(s for s, _ in health) < 1.0, health  # it answered meanwhile


def test_schema_errors_are_listed_up_to_ten_and_counted(servers):
    body = {"questions": [0] * 16, "variant": 1, "num_beams": "x", "n_docs": "y"}
    response = httpx.post(f"{servers['edits'].url}/v1/answer", json=body, timeout=60)
    error = _error(response, 422, "does not match its schema", "19 errors", "first 10")
    assert len(error["details"]) == 10
    assert error["details"][0] == {
        "loc": ["body", "questions", "0"],
        "msg": "Input should be a valid string",
        "type": "string_type",
    }
    # The bound is in the OpenAPI schema too, for clients.
    schema = httpx.get(f"{servers['edits'].url}/openapi.json").json()
    questions = schema["components"]["schemas"]["AnswerRequest"]["properties"]["questions"]
    assert questions["maxItems"] == 16


INVISIBLE = ["\u200b\u200b", "\x00", "\u200b \u2060\ufeff\u200d", "\u3164", "\u202e\x7f", "\n"]


@pytest.mark.parametrize("question", INVISIBLE, ids=ascii)
def test_a_question_with_nothing_visible_is_refused_naming_it(servers, question):
    """Zero-width characters or NULs alone were answered (200): the model answered nothing."""
    url = servers["edits"].url
    before = httpx.get(f"{url}/v1/metrics").json()["batches"]["count"]
    body = {"questions": ["where was resa nemobu born ?", question]}
    response = httpx.post(f"{url}/v1/answer", json=body, timeout=60)
    _error(response, 422, "questions[1]", "visible character")
    assert httpx.get(f"{url}/v1/metrics").json()["batches"]["count"] == before
    put = httpx.put(f"{url}/v1/passages/blank", json={"text": question}, timeout=60)
    _error(put, 422, "text: the passage has no text")
    assert httpx.get(f"{url}/v1/passages/blank").status_code == 404


def test_visible_text_is_any_drawn_character_among_invisible_ones():
    for text in ("a", "\u200bwhere\u200b ?", "\x00?", "\u0301", "\ue000", "\U0001f600"):
        assert api.has_visible(text), ascii(text)
    for text in INVISIBLE + ["", "\ufe0f", "\U000e0101", "\u2028\u2029\u3000"]:
        assert not api.has_visible(text), ascii(text)


def test_redact_cuts_the_servers_folders_from_a_message(tmp_path):
    root = tmp_path / "srv"
    message = (
        f"[Errno 30] Read-only file system: '{root}/.bundle.tmp-1/passages/x.bin'; "
        f"{root}/bundle/params/g.safetensors is corrupted; see /etc/rag/other.cfg"
    )
    assert api.redact(message, [root]) == (
        "[Errno 30] Read-only file system: '.bundle.tmp-1/passages/x.bin'; "
        "bundle/params/g.safetensors is corrupted; see other.cfg"
    )
    assert api.redact("bundle/params/g.safetensors at http://x/a/b", []) == (
        "bundle/params/g.safetensors at http://x/a/b"  # relative paths and URLs stay
    )
