"""Whether jax_decode_mlp.gated's kernel loses E4B's bandwidth to its last wave: the kernel on E4B's reduction
(2,560) and 8 rows, at feature counts whose programs (32 features each) fill the H200's 132 SMs evenly (132, 264
and 396 programs) or not (200; E4B's own 10,240: 320 programs, 2.42 a SM), against XLA's product of the same weight.
Each call's weight is one of four copies (over 200 MB in all at E4B's size), so L2 holds none of them; the calls
are chained through their outputs in one jitted function. Prints us a call and TB/s; writes JSON.

    python scripts/probe_gated_waves.py docs/results/gated-waves-h200.json
"""

import json
import sys
import time

import jax
import jax.numpy as jnp

from specdec.evidence import git_commit, now_utc
from specdec.models import jax_decode_mlp

HIDDEN, ROWS, COPIES, CALLS = 2560, 8, 4, 64
PROGRAMS = (132, 200, 264, 320, 396)  # 320: E4B's 10,240 features; 528 would pass MAX_WEIGHT_BYTES


def chained(product):
    """CALLS calls of product(x, weight), the copies in turn, each call's x the last one's first columns."""
    def run(x, weights):
        for i in range(CALLS):
            x = product(x, weights[i % COPIES])[..., :HIDDEN].astype(x.dtype)
        return x
    return jax.jit(run)


def us_a_call(run, x, weights) -> float:
    run(x, weights).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        run(x, weights).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best / CALLS * 1e6


def main() -> None:
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (1, ROWS, HIDDEN), jnp.bfloat16)
    products = {
        "gated kernel": jax_decode_mlp.gated,
        "XLA dot": lambda x, w: jnp.einsum("bth,fh->btf", x, w)[..., : w.shape[0] // 2],
    }
    rows = []
    for programs in PROGRAMS:
        features = programs * jax_decode_mlp.BLOCK_COLUMNS
        weights = [jax.random.normal(jax.random.fold_in(key, i), (2 * features, HIDDEN), jnp.bfloat16) * 0.02
                   for i in range(COPIES)]
        assert jax_decode_mlp.takes(weights[0], ROWS, jnp.bfloat16)
        nbytes = weights[0].nbytes
        row = {"programs": programs, "features": features, "weight_mb": nbytes / 1e6}
        for name, product in products.items():
            us = us_a_call(chained(product), x, weights)
            row[name] = {"us": us, "tb_s": nbytes / us / 1e6}
        rows.append(row)
        print(f"{programs:4d} programs ({programs / 132:.2f} a SM), {nbytes / 1e6:6.1f} MB: "
              + "  ".join(f"{n} {row[n]['us']:6.2f} us {row[n]['tb_s']:.2f} TB/s" for n in products), flush=True)
    record = {"benchmark": "gated-waves", "date": now_utc(), "commit": git_commit(),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__, "hidden": HIDDEN, "rows": ROWS,
              "results": rows}
    with open(sys.argv[1], "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
