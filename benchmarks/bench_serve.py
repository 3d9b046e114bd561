"""`python -m opmesh serve` against the same transformers server on "paged|sdpa": throughput and
per-request latency of concurrent clients over HTTP.

A Llama-shaped model (random weights, bf16: hidden 1024, 8 query heads and 2 key heads of dim
128, 4 layers) with a word-level tokenizer, saved locally and served on 127.0.0.1 with
continuous batching: once with opmesh (`opmesh.integrations.serving.serve`, "paged|opmesh"),
once with transformers' own `Serve` on "sdpa" (continuous batching runs it as "paged|sdpa"),
each server alone on the machine. C clients each send R chat requests one after another
(prompts of P / 2 to 3 P / 2 words, 32 new tokens, greedy, not streamed). Throughput counts the
new tokens over the wall time of all clients; latency is each request's, from sending to the
whole answer.

    python benchmarks/bench_serve.py [--clients 16] [--requests 4] [--prompt 512]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "python"))
from common import write_results  # noqa: E402
from serving_model import WORDS, save_tiny_chat_model  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind, path, port, blocks):
    if kind == "opmesh":
        from opmesh.integrations.serving import serve

        return serve(path, port=port, num_blocks=blocks, max_batch_tokens=2048, block=False)
    from transformers.cli.serve import Serve

    return Serve(
        force_model=path, continuous_batching=True, attn_implementation="sdpa", device="cpu",
        cb_num_blocks=blocks, cb_max_batch_tokens=2048, host="127.0.0.1", port=port,
        non_blocking=True,
    )  # fmt: skip


def wait_until_healthy(port, seconds=300):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if json.loads(r.read())["status"] == "ok":
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy")


def chat(port, text, new_tokens):
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": new_tokens,
            "temperature": 0}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())["usage"]["completion_tokens"]


def load(port, prompts, clients, new_tokens):
    """(new tokens, wall seconds, latencies) of the clients sending their prompts in turn."""
    latencies, counts = [], []

    def client(c):
        for text in prompts[c::clients]:
            begin = time.perf_counter()
            counts.append(chat(port, text, new_tokens))
            latencies.append(time.perf_counter() - begin)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    begin = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), time.perf_counter() - begin, sorted(latencies)


def percentile(values, q):
    return values[min(len(values) - 1, int(q * len(values)))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--prompt", type=int, default=512, help="mean prompt length, words")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    count = args.clients * args.requests
    lengths = torch.randint(args.prompt // 2, 3 * args.prompt // 2 + 1, (count,),
                            generator=generator)  # fmt: skip
    prompts = [
        " ".join(WORDS[4 + int(i)] for i in torch.randint(0, 80, (int(n),), generator=generator))
        for n in lengths
    ]
    blocks = sum(-(-(int(n) + 16 + args.new_tokens) // 256) for n in lengths) + count
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_chat_model(
            tmp, layers=4, hidden=1024, heads=8, kv_heads=2, dtype=torch.bfloat16
        )
        for kind in ("opmesh", "sdpa"):
            port = free_port()
            server = start(kind, path, port, blocks)
            try:
                wait_until_healthy(port)
                chat(port, "w1 w2 w3", 2)  # warm-up
                tokens, seconds, latencies = load(port, prompts, args.clients, args.new_tokens)
            finally:
                server.kill_server()
            rows.append({
                "server": "python -m opmesh serve (paged opmesh)" if kind == "opmesh"
                else "transformers serve, paged sdpa",
                "requests": count, "new tokens": tokens,
                "tok/s": f"{tokens / seconds:.1f}",
                "p50 latency s": f"{percentile(latencies, 0.5):.2f}",
                "p99 latency s": f"{percentile(latencies, 0.99):.2f}",
            })  # fmt: skip
            print(rows[-1], flush=True)
    ratio = float(rows[0]["tok/s"]) / float(rows[1]["tok/s"])
    rows[0]["vs sdpa"] = f"{ratio:.2f}x"
    columns = ["server", "requests", "new tokens", "tok/s", "p50 latency s", "p99 latency s",
               "vs sdpa"]  # fmt: skip
    notes = [
        f"{args.clients} clients x {args.requests} chat requests each over HTTP on 127.0.0.1, "
        f"prompts of {args.prompt // 2} to {3 * args.prompt // 2} words (one token each), "
        f"{args.new_tokens} new tokens, greedy, not streamed; the Llama-shaped model (bf16, "
        "hidden 1024, 8/2 heads of dim 128, 4 layers, random weights).",
        "tok/s: new tokens over the wall time of all clients (prefills included). Latency: one "
        "request, sent to whole answer. The two servers ran one after the other.",
    ]
    print(write_results("serve", rows, columns, notes))


if __name__ == "__main__":
    main()
