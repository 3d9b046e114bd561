"""``python -m opmesh serve``: transformers' OpenAI-compatible server with continuous batching on
opmesh, tested as a client would: a tiny random model and a tokenizer made here (no downloads)
served on 127.0.0.1, concurrent chat and completion requests (streaming and not) answered with
the model's greedy text generated offline, malformed requests answered with a 400 that names the
field while the server keeps serving, and a clean stop."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("psutil")
if not transformers.utils.import_utils.is_serve_available():
    pytest.skip("transformers[serving] is not installed", allow_module_level=True)

from serving_model import WORDS, save_tiny_chat_model  # noqa: E402

import opmesh.integrations._paged as paged  # noqa: E402
from opmesh.integrations.serving import request_problem, serve  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, path, body, timeout=120):
    """(status, JSON or SSE events) of a POST; SSE answers come back as their data objects."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read().decode())
    if text.startswith("data:"):
        events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        return status, [json.loads(e) for e in events if e != "[DONE]"]
    return status, json.loads(text)


def get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return response.status, json.loads(response.read().decode())


def wait_until_healthy(port, seconds=120, alive=lambda: True):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert alive(), "the server exited"
        try:
            if get(port, "/health")[1].get("status") == "ok":
                return
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become healthy")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat")))


@pytest.fixture(scope="module")
def server(model_dir):
    """The server in this process (a background thread), its flash_attn calls counted."""
    calls = []
    own = paged.ops.flash_attn

    def counted(*args, **kwargs):
        calls.append(1)
        return own(*args, **kwargs)

    paged.ops.flash_attn = counted
    port = free_port()
    running = serve(model_dir, port=port, num_blocks=64, max_batch_tokens=64, block=False)
    try:
        wait_until_healthy(port)
        yield port, calls
    finally:
        running.kill_server()
        paged.ops.flash_attn = own
        assert not running._thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def offline(model_dir):
    """The model's greedy text for token ids, generated in this process without batching."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    lock = threading.Lock()

    def answer(ids, new_tokens):
        with lock, torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
        return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)

    return tokenizer, answer


def text_of(kind, stream, answer):
    if not stream:
        choice = answer["choices"][0]
        return choice["message"]["content"] if kind == "chat" else choice["text"]
    key = "delta" if kind == "chat" else None
    parts = []
    for event in answer:
        for choice in event["choices"]:
            part = choice[key].get("content") if key else choice.get("text")
            parts.append(part or "")
    return "".join(parts)


def test_concurrent_clients_get_the_offline_greedy_answers(server, offline):
    """8 clients send 10 requests each at once: chat and completions, streaming and not, of
    different lengths. Every one is answered with the text the model generates alone."""
    port, calls = server
    tokenizer, answer = offline
    before = len(calls)
    results, errors = [], []

    def client(c):
        gen = torch.Generator().manual_seed(c)
        for r in range(10):
            words = [WORDS[4 + int(i)] for i in torch.randint(0, 80, (2 + (c * 7 + r) % 15,),
                                                              generator=gen)]  # fmt: skip
            text = " ".join(words)
            new_tokens = 1 + (c + 3 * r) % 8
            kind = "chat" if (c + r) % 2 == 0 else "completion"
            stream = (c + r) % 3 == 0
            body = {"max_tokens": new_tokens, "temperature": 0, "stream": stream}
            if kind == "chat":
                messages = [{"role": "user", "content": text}]
                body["messages"] = messages
                ids = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
                path = "/v1/chat/completions"
            else:
                body["prompt"] = text
                ids = tokenizer(text)["input_ids"]
                path = "/v1/completions"
            try:
                status, got = post(port, path, body)
                results.append((status, text_of(kind, stream, got), ids, new_tokens))
            except Exception as error:  # reported below, with the request
                errors.append((kind, stream, repr(error)))

    clients = [threading.Thread(target=client, args=(c,)) for c in range(8)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(timeout=600)
    assert not errors, errors[:3]
    assert len(results) == 80
    for status, got, ids, new_tokens in results:
        assert status == 200
        assert got == answer(ids, new_tokens)
    assert len(calls) > before  # the batches ran on paged|opmesh


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/chat/completions", {"messages": "hello"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "w1"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
        ("/v1/chat/completions", [1, 2], "body"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": "w1", "max_tokens": -3}, "max_tokens"),
        ("/v1/completions", {"prompt": "w1", "max_tokens": 2.5}, "max_tokens"),
        ("/v1/completions", {"prompt": "w1", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "w1", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "w1", "stream": "yes"}, "stream"),
    ],
)
def test_a_malformed_request_gets_a_400_naming_the_field(server, path, body, field):
    port, _ = server
    status, got = post(port, path, body)
    assert status == 400
    assert got["error"]["message"].startswith(f"{field}:"), got
    assert got["error"]["param"] == field
    # and the server keeps serving
    status, ok = post(port, "/v1/completions", {"prompt": "w1 w2", "max_tokens": 2})
    assert status == 200 and ok["choices"][0]["finish_reason"] in ("length", "stop")


def test_what_is_not_json_gets_a_4xx_and_the_server_keeps_serving(server):
    port, _ = server
    status, got = post(port, "/v1/chat/completions", b"{not json")
    assert 400 <= status < 500 and got
    status, _ = post(port, "/v1/completions", {"prompt": "w3", "max_tokens": 1})
    assert status == 200


def test_the_model_list_names_the_served_model(server, model_dir):
    port, _ = server
    status, got = get(port, "/v1/models")
    assert status == 200 and [m["id"] for m in got["data"]] == [model_dir]


def test_request_checks_pass_what_openai_clients_send():
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "stream": True}  # fmt: skip
    assert request_problem("/v1/chat/completions", chat) is None
    assert request_problem("/v1/completions", {"prompt": "hi", "max_tokens": 1}) is None


@pytest.mark.parametrize(
    "stop,options", [(signal.SIGTERM, ["--kv-cache", "int8"]), (signal.SIGINT, [])]
)
def test_the_command_line_serves_and_stops_cleanly(model_dir, stop, options):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen(
        [sys.executable, "-m", "opmesh", "serve", model_dir, "--port", str(port),
         "--num-blocks", "32", *options],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_until_healthy(port, alive=lambda: process.poll() is None)
        status, got = post(port, "/v1/completions", {"prompt": "w1 w2", "max_tokens": 3})
        assert status == 200 and got["usage"]["completion_tokens"] <= 3
        process.send_signal(stop)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_model_that_does_not_load_is_named():
    done = subprocess.run(
        [sys.executable, "-m", "opmesh", "serve", "/nonexistent/model", "--port", str(free_port())],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    assert "python -m opmesh serve: error: model: cannot serve '/nonexistent/model'" in done.stderr


def test_a_port_in_use_is_named(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "opmesh", "serve", model_dir, "--port", str(port),
             "--num-blocks", "32"],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
    assert done.returncode == 2
    assert f"python -m opmesh serve: error: port: the server on 127.0.0.1:{port}" in done.stderr
