r"""Load on the server: rag_jax's `experiments/serve.py` against transformers served the usual way.

    python benchmarks/serve_load.py --bundle /tmp/rag_default/bundle     # ~5 min on 2 CPU cores
    python benchmarks/serve_load.py --cold --requests 0     # our cold start alone: ready, compiled

Both servers run on 127.0.0.1 in subprocesses of this one run, over the same model: ours serves
the bundle (dynamic batching, a pipeline of preparation and generation); the baseline serves its
HF export (`Bundle.to_hf`: `Rag*ForGeneration`, `RagRetriever` over the same passages and an
exact faiss index of the same vectors) with a minimal FastAPI app that answers each request with
one `generate` call under a lock, torch on as many threads as the machine has cores. Each server
starts on its own and is timed to `/healthz` 200 ("ready_s") and, ours, to every program
compiled ("compiled_s": it turns ready after the first and compiles the rest in the background;
`--cold` compiles them from nothing, in a cache of the run's own). The same client, 16
concurrent connections, sends one-question requests (the run's held-out questions, in turn):
`--warmup` untimed to each, then `--requests` timed to each, in `--rounds` rounds that alternate
between the servers, so that a shared machine's load drifting during the run weighs on both
alike. It reports requests/s, p50/p99 latency, errors, the load average before each round, how
often the two servers' answers agree, and from our server's /v1/metrics the mean batch and
whether anything compiled under load. Writes `bench_results/serve_load.json`.

`--hf_server DIR --port P` is the baseline server itself (started by the run).
"""

import argparse
import asyncio
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# The baseline: transformers, one generate call per request


def hf_app(directory: str, threads: int):
    """A FastAPI app answering POST /v1/answer {"questions": [q]} with HF's RAG (`generate`,
    retrieval inside it) under a lock: how transformers' RAG is served without a batcher."""
    import fastapi
    import torch
    import transformers

    torch.set_num_threads(threads)
    config = json.loads((pathlib.Path(directory) / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    retriever = transformers.RagRetriever.from_pretrained(
        directory,
        index_name="custom",
        passages_path=config["passages_path"],
        index_path=config["index_path"],
    )
    model = cls.from_pretrained(directory).eval()
    model.set_retriever(retriever)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        pathlib.Path(directory) / "question_encoder_tokenizer"
    )
    generator_tokenizer = transformers.AutoTokenizer.from_pretrained(
        pathlib.Path(directory) / "generator_tokenizer"
    )
    lock = threading.Lock()
    app = fastapi.FastAPI()

    @app.post("/v1/answer")
    def answer(body: dict):
        questions = body["questions"]
        x = tokenizer(questions, return_tensors="pt", padding=True)
        with lock, torch.no_grad():
            out = model.generate(input_ids=x["input_ids"], attention_mask=x["attention_mask"])
        texts = generator_tokenizer.batch_decode(out, skip_special_tokens=True)
        return {"answers": [{"question": q, "answer": t.strip()} for q, t in zip(questions, texts)]}

    @app.get("/healthz")
    def healthz():
        return {"ready": True}

    return app


# ---------------------------------------------------------------------------------------------
# The load


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], log: pathlib.Path, **env) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", **env)
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, *args, "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return process, f"http://127.0.0.1:{port}"


def _wait_ready(process, url: str, log: pathlib.Path, timeout: float = 900.0) -> dict:
    """Seconds from now until `/healthz` answers 200 ("ready_s") and, for our server, until it
    says every program is compiled ("compiled_s": it turns ready first, then compiles the other
    batch buckets and context widths in the background)."""
    import httpx

    start, out = time.monotonic(), {}
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited:\n{log.read_text()[-3000:]}")
        try:
            health = httpx.get(f"{url}/healthz", timeout=2)
            if health.status_code == 200:
                out.setdefault("ready_s", round(time.monotonic() - start, 1))
                if health.json().get("compiled", True):
                    out["compiled_s"] = round(time.monotonic() - start, 1)
                    return out
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout} s")


async def _load(url: str, questions: list[str], requests: int, clients: int, first=0) -> dict:
    """`requests` one-question POSTs from `clients` concurrent connections, asking
    `questions[first:]` in turn: {"latencies" (s), "answers", "errors", "seconds"}."""
    import httpx

    latencies, answers, errors = [], {}, []
    next_request = iter(range(first, first + requests))

    async def client(http):
        for i in next_request:
            q = questions[i % len(questions)]
            start = time.perf_counter()
            try:
                r = await http.post(f"{url}/v1/answer", json={"questions": [q]})
                if r.status_code != 200:
                    errors.append(f"{r.status_code}: {r.text[:200]}")
                    continue
                answers[q] = r.json()["answers"][0]["answer"]
            except httpx.HTTPError as e:
                errors.append(repr(e))
                continue
            latencies.append(time.perf_counter() - start)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        seconds = time.perf_counter() - start
    return {"latencies": latencies, "answers": answers, "errors": errors, "seconds": seconds}


def _summary(rounds: list[dict]) -> dict:
    """Requests/s over the rounds' summed time, latency percentiles over all their requests."""
    latencies = [x for r in rounds for x in r["latencies"]]
    errors = [e for r in rounds for e in r["errors"]]
    seconds = sum(r["seconds"] for r in rounds)
    ms = np.asarray(latencies) * 1e3
    return {
        "requests": len(latencies) + len(errors),
        "errors": len(errors),
        "first_errors": errors[:3],
        "seconds": round(seconds, 2),
        "requests_per_s": round(len(latencies) / seconds, 1),
        "rounds_requests_per_s": [round(len(r["latencies"]) / r["seconds"], 1) for r in rounds],
        "p50_ms": round(float(np.percentile(ms, 50)), 1) if ms.size else None,
        "p99_ms": round(float(np.percentile(ms, 99)), 1) if ms.size else None,
        "answers": {q: a for r in rounds for q, a in r["answers"].items()},
    }


def _questions(bundle_dir: pathlib.Path, path: str | None) -> list[str]:
    path = pathlib.Path(path) if path else bundle_dir.parent / "predictions.jsonl"
    return [json.loads(line)["question"] for line in path.read_text().splitlines()]


def run(args) -> dict:
    from rag_jax.io import bundle

    bundle_dir = pathlib.Path(args.bundle)
    questions = _questions(bundle_dir, args.questions)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="serve_load_"))
    model = bundle.load(bundle_dir)
    if args.requests:
        model.to_hf(tmp / "hf")
    setting = {
        "variant": model.settings.variant,
        "num_beams": model.rag_cfg.generation.num_beams,
        "n_docs": model.rag_cfg.n_docs,
        "passages": len(model.store),
    }
    del model
    servers = {
        "rag_jax": [str(REPO / "experiments" / "serve.py"), "--bundle", str(bundle_dir)]
        + [f"--max_batch={args.max_batch}", f"--max_wait_ms={args.max_wait_ms}"]
        # Every client is 127.0.0.1: one address's share of the connections must hold them all.
        + [f"--max_connections_per_client={max(args.clients, 64)}"],
        "transformers": [__file__, "--hf_server", str(tmp / "hf"), f"--threads={args.threads}"],
    }
    # Our server's compiled programs: in a cache of this run's own with --cold (compiled from
    # nothing, as a first start), else in the usual persistent cache (`enable_compilation_cache`).
    cache = {"RAG_JAX_COMPILATION_CACHE": str(tmp / "jax_cache")} if args.cold else {}
    if not args.requests:  # the start-up alone
        servers = {"rag_jax": servers["rag_jax"]}
    results = {"setting": setting, "clients": args.clients, "load_before": os.getloadavg()}
    urls, processes = {}, []
    try:
        for name, command in servers.items():  # one after the other: each starts on its own
            log = tmp / f"{name}.log"
            process, urls[name] = _start(command, log, **(cache if name == "rag_jax" else {}))
            processes.append(process)
            results[name] = _wait_ready(process, urls[name], log)
            print(name, results[name], flush=True)
        if args.requests:
            _timed(args, questions, urls, results)
    finally:
        for process in processes:
            process.terminate()
            process.wait(60)
    if not args.requests:
        return results
    ours, ref = results["rag_jax"], results["transformers"]
    same = [q for q in ref["answers"] if ours["answers"].get(q) == ref["answers"][q]]
    results["answers_agree"] = f"{len(same)}/{len(ref['answers'])}"
    results["speedup"] = round(ours["requests_per_s"] / ref["requests_per_s"], 2)
    results["load_after"] = os.getloadavg()
    for name in servers:
        del results[name]["answers"]
    return results


def _timed(args, questions: list[str], urls: dict, results: dict) -> None:
    """The timed load, in `args.rounds` rounds that alternate between the servers (the first
    to go changes each round): a machine whose load drifts during the run weighs on both alike.
    Adds each server's `_summary` (ours also: its mean batch and its compiles under load) to
    `results`, and the load average before each round."""
    import httpx

    for url in urls.values():
        asyncio.run(_load(url, questions, args.warmup, args.clients))  # warm-up, untimed
    before = httpx.get(f"{urls['rag_jax']}/v1/metrics").json()
    rounds, loads = {name: [] for name in urls}, []
    per_round = -(-args.requests // args.rounds)
    for i in range(args.rounds):
        loads.append(os.getloadavg()[0])
        names = list(urls) if i % 2 == 0 else list(urls)[::-1]
        for name in names:
            load = _load(urls[name], questions, per_round, args.clients, first=i * per_round)
            rounds[name].append(asyncio.run(load))
    after = httpx.get(f"{urls['rag_jax']}/v1/metrics").json()
    for name, parts in rounds.items():
        results[name].update(_summary(parts))
        print(name, {k: v for k, v in results[name].items() if k != "answers"}, flush=True)
    results["load_per_round"] = [round(x, 2) for x in loads]
    b0, b1 = before["batches"], after["batches"]
    results["rag_jax"]["compiles_under_load"] = after["compiles"] - before["compiles"]
    results["rag_jax"]["mean_batch"] = round(
        (b1["questions"] - b0["questions"]) / max(1, b1["count"] - b0["count"]), 2
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default="/tmp/rag_default/bundle", help="a bundle folder")
    parser.add_argument("--questions", default=None, help="JSONL with 'question' fields")
    parser.add_argument(
        "--requests", type=int, default=2000, help="timed requests per server; 0: our start-up only"
    )
    parser.add_argument("--warmup", type=int, default=64, help="untimed requests first")
    parser.add_argument(
        "--rounds", type=int, default=4, help="timed rounds, alternating between the servers"
    )
    parser.add_argument("--clients", type=int, default=16, help="concurrent connections")
    parser.add_argument("--max_batch", type=int, default=16, help="our server's --max_batch")
    parser.add_argument("--max_wait_ms", type=float, default=3.0, help="our --max_wait_ms")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument(
        "--cold", action="store_true", help="our server compiles from nothing (its own cache)"
    )
    parser.add_argument("--out", default="bench_results/serve_load.json")
    parser.add_argument("--hf_server", default=None, help="(internal) serve this HF export")
    parser.add_argument("--port", type=int, default=0, help="(internal) the HF server's port")
    args = parser.parse_args(argv)
    if args.hf_server:
        import uvicorn

        app = hf_app(args.hf_server, args.threads)
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
        return
    results = run(args)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
