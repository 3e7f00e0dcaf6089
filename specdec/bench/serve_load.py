"""A load generator for `specdec serve` and the servers users would pick instead (`vllm serve`): N concurrent OpenAI
clients, each sending streamed completions one after another, at several concurrencies. Per concurrency:
requests/s and generated tokens/s over the wall time, the medians of time to first token, time per output token
after the first and request latency, and the server's acceptance length over those requests (vLLM's
spec_decode counters, which both servers export; our tau as well). scripts/bench_serve.py is the command line.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from specdec.bench.vllm_peer import speculative_for_vllm, vllm_environment, vllm_version
from specdec.errors import SpecdecError
from specdec.evidence import git_commit, now_utc
from specdec.serve.scheduler import widths_label


@dataclass
class LoadSettings:
    url: str  # the server's root, e.g. http://127.0.0.1:8000
    prompts: list[str]
    concurrencies: tuple[int, ...] = (1, 4, 16)
    requests_per_client: int = 4
    max_tokens: int = 128
    temperature: float = 0.0


def scrape_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """The server's /metrics as {(sample name, ((label, value), ...)): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def spec_decode_total(metrics: dict, name: str) -> float:
    """A spec_decode counter over all its label sets, under our prefix or vLLM's (`specdec:` / `vllm:`)."""
    names = {f"{prefix}:spec_decode_{name}_total" for prefix in ("specdec", "vllm")}
    return sum(value for (sample, _labels), value in metrics.items() if sample in names)


def run_load(settings: LoadSettings, log=print, server: dict | None = None) -> dict:
    """Every concurrency in turn, after one warm-up request; -> the record (device, date, commit, settings,
    one row per concurrency). `server` names a server whose /health says nothing of itself (a peer's): engine,
    device, max_num_seqs, speculative_config."""
    import openai

    client = openai.OpenAI(base_url=settings.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    health = server or httpx.get(settings.url + "/health").json()
    _one_request(client, model, settings.prompts[0], settings, max_tokens=4)
    levels = []
    for concurrency in settings.concurrencies:
        level = _run_level(client, model, settings, concurrency)
        log(f"concurrency {concurrency}: {level['requests_per_s']:.2f} req/s, {level['tokens_per_s']:,.0f} tok/s")
        levels.append(level)
    return {"device": health.get("device"), "engine": health.get("engine"), "max_num_seqs": health["max_num_seqs"],
            "cycles_per_call": health.get("cycles_per_call"), "cycle_widths": health.get("cycle_widths"),
            "speculative_config": health.get("speculative_config"),
            "date": now_utc(), "commit": git_commit(), "model": model,
            "settings": {**asdict(settings), "prompts": len(settings.prompts)}, "levels": levels}


def run_load_apart(settings: LoadSettings) -> dict:
    """run_load in a process of its own (specdec.bench.child). Beside a server in this process, the clients' threads
    (streaming, JSON) would hold the server's GIL for their share of the time and slow it down."""
    from specdec.bench.child import run_child

    status, record = run_child([sys.executable, "-m", "specdec.bench.serve_load", json.dumps(asdict(settings))])
    if status != 0 or record is None:
        raise RuntimeError(f"the load's clients failed (exit {status}; their error is above)")
    return record


class VllmServer:
    """`vllm serve` of a target in a process of its own, drafting as a `specdec serve --speculative-config` would
    (vLLM's spelling already; specdec.bench.vllm_peer says what changes on the way)."""

    def __init__(self, target: Path, speculative: dict | None, max_num_seqs: int, max_model_len: int, log_path: Path):
        speculative, backend = speculative_for_vllm(speculative)
        self.target, self.speculative, self.max_num_seqs = Path(target), speculative, max_num_seqs
        self.port = free_port()
        self.command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
                        "--served-model-name", self.target.name, "--dtype", "bfloat16", "--seed", "0",
                        "--port", str(self.port), "--max-num-seqs", str(max_num_seqs),
                        "--max-model-len", str(max_model_len)]
        if speculative:
            self.command += ["--speculative-config", json.dumps(speculative)]
        for name, value in backend.items():  # the LLM's options, as flags
            self.command += ["--" + name.replace("_", "-"), value]
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 900) -> str:
        """Starts it and waits until /health answers 200; -> its root URL. A server that exits or does not answer in
        time is an error naming the last lines of its log."""
        env = dict(os.environ)
        vllm_environment(env)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.process = None
                raise SpecdecError(f"vllm serve exited before it answered: {self._log_tail()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise SpecdecError(f"vllm serve did not answer in {timeout_s:.0f} s: {self._log_tail()}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
            self.process = None

    def about(self) -> dict:
        """What its /health does not say (run_load's `server`)."""
        return {"engine": f"vllm {vllm_version()}", "device": gpu_name(), "max_num_seqs": self.max_num_seqs,
                "speculative_config": self.speculative}

    def _log_tail(self, lines: int = 5) -> str:
        tail = [line.strip() for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        return " | ".join(tail[-lines:]) + f" (whole log: {self.log_path})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_name() -> str | None:
    """The first GPU's name as the driver gives it (the name torch reports), without starting CUDA here."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True)
    except FileNotFoundError:
        return None
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def _run_level(client, model: str, settings: LoadSettings, concurrency: int) -> dict:
    before = scrape_metrics(settings.url)
    count = concurrency * settings.requests_per_client

    def client_loop(worker: int) -> list[tuple[float, float, int]]:
        return [_one_request(client, model, settings.prompts[(worker * settings.requests_per_client + j)
                                                             % len(settings.prompts)], settings)
                for j in range(settings.requests_per_client)]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = [r for rs in pool.map(client_loop, range(concurrency)) for r in rs]
    wall = time.perf_counter() - start
    after = scrape_metrics(settings.url)

    def delta(name: str) -> float:
        return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)

    ttft, latency, tokens = zip(*results)
    cycles = delta("specdec_verify_cycles_total")  # ours only
    drafts = spec_decode_total(after, "num_drafts") - spec_decode_total(before, "num_drafts")
    accepted = spec_decode_total(after, "num_accepted_tokens") - spec_decode_total(before, "num_accepted_tokens")
    # time per output token after the first, per request (as vLLM's benchmarks define TPOT)
    tpot = [(end - first) / (n - 1) for first, end, n in results if n > 1]
    return {
        "concurrency": concurrency, "requests": count, "seconds": wall, "requests_per_s": count / wall,
        "tokens": sum(tokens), "tokens_per_s": sum(tokens) / wall, "ttft_p50_s": statistics.median(ttft),
        "tpot_p50_s": statistics.median(tpot) if tpot else None, "latency_p50_s": statistics.median(latency),
        "tau": delta("specdec_emitted_tokens_total") / cycles if cycles else None,
        "acceptance_length": 1 + accepted / drafts if drafts else None,  # tokens per drafted verify, vLLM's
    }


def _one_request(client, model: str, prompt: str, settings: LoadSettings, max_tokens: int | None = None):
    """One streamed completion; -> (seconds to the first text, seconds to the end, tokens generated)."""
    start = time.perf_counter()
    first, tokens = None, 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens or settings.max_tokens,
                                       temperature=settings.temperature, stream=True,
                                       stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return (first or end) - start, end - start, tokens


def print_table(record: dict, console) -> None:
    from rich.table import Table

    s = record["settings"]
    table = Table("clients", "requests", "req/s", "tok/s", "TTFT p50 ms", "TPOT p50 ms", "latency p50 s",
                  "acceptance length",
                  title=f"{record['model']} · {record['device']} · {record['engine']} · {record['max_num_seqs']} rows · "
                        f"{s['max_tokens']} tokens per request · commit {record['commit']}")
    for level in record["levels"]:
        length, tpot = level.get("acceptance_length"), level.get("tpot_p50_s")
        table.add_row(str(level["concurrency"]), str(level["requests"]), f"{level['requests_per_s']:.2f}",
                      f"{level['tokens_per_s']:,.0f}", f"{level['ttft_p50_s'] * 1e3:.0f}",
                      "" if tpot is None else f"{tpot * 1e3:.2f}", f"{level['latency_p50_s']:.2f}",
                      "" if length is None else f"{length:.2f}")
    console.print(table)


def describe(record: dict) -> str:
    """A record's server in a few words: engine, commit, drafting, cycles a call where more than one, and the widths
    a torch cycle runs over where it runs over fewer rows than all."""
    spec = record.get("speculative_config") or {}
    k, method = spec.get("num_speculative_tokens") or 0, spec.get("method")
    flavour = ((" parallel" if spec.get("parallel_drafting") else "")
               + (" after n-gram" if spec.get("ngram_first") else ""))
    drafting = f"{method}{flavour} k={k}" if method and k else "plain decoding"
    cycles = record.get("cycles_per_call") or 1
    return (f"{record['engine']} {record['commit']}, " + drafting
            + (f", {cycles} cycles a call" if cycles > 1 else "") + widths_label(record.get("cycle_widths") or []))


def plot_load(records: list[dict], path) -> None:
    """Generated tokens/s and median request latency against concurrent clients, one line per record."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tokens, latency) = plt.subplots(1, 2, figsize=(9, 3.8))
    for record in records:
        clients = [level["concurrency"] for level in record["levels"]]
        tokens.plot(clients, [level["tokens_per_s"] for level in record["levels"]], "o-", label=describe(record))
        latency.plot(clients, [level["latency_p50_s"] for level in record["levels"]], "o-", label=describe(record))
    for ax, label in ((tokens, "generated tokens / s"), (latency, "request latency, median (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients, [str(c) for c in clients])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    tokens.legend(fontsize=8)
    first = records[0]
    commits = {record["commit"] for record in records}  # each line names its own when they differ
    fig.suptitle(f"specdec serve · {first['model']} · {first['device']} · {first['settings']['max_tokens']} tokens "
                 f"per request" + (f" · commit {first['commit']}" if len(commits) == 1 else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # run_load_apart's child
    from specdec.bench.child import say

    fields = json.loads(sys.argv[1])
    say({"result": run_load(LoadSettings(**{**fields, "concurrencies": tuple(fields["concurrencies"])}),
                            log=lambda line: print(line, file=sys.stderr, flush=True))})
