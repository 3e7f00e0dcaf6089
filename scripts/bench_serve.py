"""Load-test `specdec serve` (or `vllm serve`): N concurrent OpenAI clients at several concurrencies, requests/s
and tokens/s.

    python scripts/bench_serve.py --url http://127.0.0.1:8000 [--concurrency 1,4,16] [--max-tokens 128]
    python scripts/bench_serve.py --target DIR [--engine torch] [--max-num-seqs 16] \\
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}']    # starts a server in-process
                                                                                   # (the clients run in a child)
    python scripts/bench_serve.py --peer vllm --target DIR [--speculative-config ...]  # the same load on `vllm serve`

Each client sends --requests-per-client streamed completions one after another, prompts taken in turn from
--prompts (default: scripts/prompts/identical_greedy.jsonl). Prints a table and writes JSON (device, date,
commit, one row per concurrency: req/s, tok/s, median time to first token and latency, the server's tau).
The logic lives in specdec.bench.serve_load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from specdec.data.sources import read_prompts
from specdec.models.gguf_import import default_checkpoint
from specdec.models.tokenizer import Tokenizer
from specdec.bench.serve_load import LoadSettings, plot_load, print_table, run_load, run_load_apart

DEFAULT_PROMPTS = Path(__file__).parent / "prompts" / "identical_greedy.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server; without it one is started in-process")
    parser.add_argument("--target", type=Path,
                        help="checkpoint of the in-process server, whose tokenizer reads the prompts [default: the embedded 270M]")
    parser.add_argument("--engine", default="torch")
    parser.add_argument("--peer", choices=["vllm"], help="start this server for --target instead of ours (a process of "
                        "its own, the same --speculative-config; its log beside --out)")
    parser.add_argument("--max-num-seqs", type=int, help="rows of the server started here [default: the largest concurrency]")
    parser.add_argument("--max-model-len", type=int, default=2048, help="the context of a --peer server")
    parser.add_argument("--speculative-config", help="the in-process server's, as `specdec serve` takes it")
    parser.add_argument("--cycles-per-call", type=int, help="the in-process JAX server's [default: the server's]")
    parser.add_argument("--no-narrow-cycles", action="store_true",
                        help="the in-process torch server runs every row in every cycle (`specdec serve`'s flag)")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out", type=Path, default=Path("serve-bench.json"))
    parser.add_argument("--compare", type=Path, nargs="*", default=[],
                        help="earlier --out files drawn beside this run in the PNG (written next to --out)")
    args = parser.parse_args()

    concurrencies = tuple(int(c) for c in args.concurrency.split(","))
    server = peer = None
    url = args.url
    if args.peer and (url or not args.target):
        parser.error("--peer starts its server for --target: give --target, not --url")
    if args.peer:
        from specdec.bench.serve_load import VllmServer
        from specdec.serve.scheduler import SpeculativeConfig

        spec = SpeculativeConfig.from_json(args.speculative_config)  # checked as ours checks it
        peer = VllmServer(args.target, spec.as_json() if spec.k else None, args.max_num_seqs or max(concurrencies),
                          args.max_model_len, args.out.with_suffix(".log"))
        url = peer.start()
        print(f"vllm serve at {url}", flush=True)
    elif url is None:
        from specdec.serve.app import ModelServer, ServeConfig
        from specdec.serve.scheduler import SpeculativeConfig

        server = ModelServer(ServeConfig(
            target=args.target, engine=args.engine, port=0, max_num_seqs=args.max_num_seqs or max(concurrencies),
            speculative=SpeculativeConfig.from_json(args.speculative_config), cycles_per_call=args.cycles_per_call,
            narrow_cycles=not args.no_narrow_cycles))
        url = server.start()
        print(f"server at {url}", flush=True)
    try:
        tokenizer = server.tokenizer if server else Tokenizer.from_dir(args.target or default_checkpoint())
        prompts = read_prompts(args.prompts, tokenizer)
        settings = LoadSettings(url=url.rstrip("/"), prompts=prompts, concurrencies=concurrencies,
                                requests_per_client=args.requests_per_client, max_tokens=args.max_tokens,
                                temperature=args.temperature)
        if server is not None:
            record = run_load_apart(settings)
        else:
            record = run_load(settings, server=peer.about() if peer else None)
    finally:
        if server is not None:
            server.stop()
        if peer is not None:
            peer.stop()
    print_table(record, Console())
    args.out.write_text(json.dumps(record, indent=1))
    plot_load([record] + [json.loads(path.read_text()) for path in args.compare], args.out.with_suffix(".png"))
    print(f"results in {args.out}, plot in {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
