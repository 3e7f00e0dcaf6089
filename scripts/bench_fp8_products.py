"""FP8 products in XLA, alone: 8 rows by a weight of each model's shape, 16 products chained in a lax.scan, as bf16,
as FP8 dequantized before the product (values times scales, then the product), and as FP8 with the scale on the
float32 product (specdec.models.fp8). Prints us a product and TB/s of weight read, and whether XLA's optimized
program holds the weight in bf16 (written each step, not fused into the GEMM). Writes JSON (device, date, commit).

    python scripts/bench_fp8_products.py --out docs/results/fp8-products-h200.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from specdec.evidence import git_commit, now_utc
from specdec.models import jax_fp8 as fp8

SHAPES = {"270m lm_head": (262144, 640), "270m gate/up": (4096, 640), "270m down": (640, 2048),
          "31b gate/up": (43008, 5376), "31b down": (5376, 21504), "e4b gate/up": (20480, 2560)}
ROWS, STEPS = 8, 16


def chained(product, k: int):
    """STEPS products, each row's next input its last output's first k columns (tiled where the output is narrower)."""
    def run(x, weight):
        def body(x, _):
            y = product(x, weight)
            z = jnp.tile(y, (1, -(-k // y.shape[-1])))[:, :k]
            return (x + z * jnp.bfloat16(1e-3)).astype(x.dtype), None
        return jax.lax.scan(body, x, length=STEPS)[0]
    return jax.jit(run)


def writes_bf16_weight(hlo: str, n: int, k: int) -> bool:
    """Whether a kernel of the optimized program (an instruction outside the fused computations) outputs a bf16
    [n, k] array: the weight converted in a pass of its own rather than inside the GEMM."""
    blocks = re.split(r"\n(?=%\S+ \(|ENTRY )", hlo)
    fused = set(re.findall(r"calls=(%[\w.\-]+)", hlo))
    outer = [b for b in blocks if b.split(" ", 1)[0] not in fused]
    return any(re.search(rf"= bf16\[{n},{k}\]", b) for b in outer)


VARIANTS = {
    "bf16": lambda x, w: x @ w.T,
    "fp8, dequantized first": lambda x, w: x @ fp8.dequantized(w, jnp.bfloat16).T,
    "fp8, scaled product": lambda x, w: fp8.product(x, w).astype(x.dtype),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("fp8-products.json"))
    args = parser.parse_args()
    rows = []
    for name, (n, k) in SHAPES.items():
        weight = jax.random.normal(jax.random.key(0), (n, k), jnp.float32) * k**-0.5
        weights = {"bf16": weight.astype(jnp.bfloat16)} | dict.fromkeys(list(VARIANTS)[1:], fp8.quantize(weight))
        x = jax.random.normal(jax.random.key(1), (ROWS, k), jnp.bfloat16)
        for variant, product in VARIANTS.items():
            run = chained(product, k)
            text = run.lower(x, weights[variant]).compile().as_text()
            jax.block_until_ready(run(x, weights[variant]))
            seconds = []
            for _ in range(5):
                start = time.perf_counter()
                jax.block_until_ready(run(x, weights[variant]))
                seconds.append(time.perf_counter() - start)
            us = min(seconds) / STEPS * 1e6
            weight_bytes = n * k * (2 if variant == "bf16" else 1)
            held_in_bf16 = variant != "bf16" and writes_bf16_weight(text, n, k)
            rows.append({"shape": name, "n": n, "k": k, "variant": variant, "us": us,
                         "tb_s": weight_bytes / us / 1e6, "weight_written_in_bf16": held_in_bf16})
            print(f"{name:<14} {variant:<24} {us:9.2f} us {weight_bytes / us / 1e6:6.2f} TB/s"
                  f"{'  (weight written in bf16)' if held_in_bf16 else ''}", flush=True)
    record = {"benchmark": "fp8_products", "date": now_utc(), "commit": git_commit(),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows_per_product": ROWS,
              "products_chained": STEPS, "results": rows}
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
