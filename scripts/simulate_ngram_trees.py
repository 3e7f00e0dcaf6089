"""What draft trees of n-gram candidates would buy over a chain: tau simulated on the target's plain greedy outputs.

    python scripts/simulate_ngram_trees.py [--outputs plain.json] [--max-new-tokens 128]

Decodes the three held-out prompt sets (the packaged 8, scripts/prompts/identical_greedy.jsonl, the 48 held-out
corpus files) with the embedded 270M, greedy and plain (cached in --outputs), then replays each output cycle by cycle:
a chain drafts lookup's continuation (specdec.drafters.ngram's rule), a tree up to B distinct continuations (longer
match first, then the most recent), merged into a trie within a verify width. A cycle emits its longest agreeing
path + 1, as greedy verification would."""
import argparse
import json
from importlib import resources
from pathlib import Path

import numpy as np

SETS = {"packaged": None, "identical": Path(__file__).parent / "prompts" / "identical_greedy.jsonl",
        "heldout48": Path(__file__).parents[1] / "docs" / "results" / "eagle3-heldout48.jsonl"}


def plain_outputs(path: Path, max_new_tokens: int) -> list[dict]:
    if path.exists():
        return json.loads(path.read_text())
    import specdec
    from specdec.data.sources import read_prompts

    target = specdec.load(batch=16, k_max=0)
    rows = []
    for name, file in SETS.items():
        with resources.as_file(file or resources.files("specdec") / "prompts" / "bench.jsonl") as p:
            texts = read_prompts(p, target.tokenizer)
        for i in range(0, len(texts), 16):
            chunk = texts[i:i + 16]
            _, gen = specdec.generate(chunk + chunk[-1:] * (16 - len(chunk)), target, drafter="none", k=0,
                                      max_new_tokens=max_new_tokens)
            rows += [{"set": name, "prompt_ids": target.tokenizer.encode(t), "output": list(map(int, gen.tokens[j]))}
                     for j, t in enumerate(chunk)]
    path.write_text(json.dumps(rows))
    return rows


def continuations(tokens: list[int], k: int, limit: int, lo: int = 1, hi: int = 3) -> list[tuple]:
    """Up to `limit` distinct continuations of up to k tokens: matches of hi down to lo tokens, most recent first."""
    tokens, found = np.asarray(tokens), []
    for n in range(hi, lo - 1, -1):
        if len(tokens) < n + 1:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        for start in np.flatnonzero((windows == tokens[-n:]).all(axis=1))[::-1]:
            draft = tuple(tokens[start + n:start + n + k].tolist())
            if draft and draft not in found:
                found.append(draft)
                if len(found) == limit:
                    return found
    return found


def within(drafts: list[tuple], width: int) -> list[tuple]:
    """The drafts' trie cut to `width` - 1 nodes (the pending token is the root), in the drafts' order."""
    nodes, kept = set(), []
    for draft in drafts:
        prefixes = [draft[:j + 1] for j in range(len(draft))]
        fit = [p for p in prefixes if p in nodes or len(nodes) < width - 1 and not nodes.add(p)]
        if fit:
            kept.append(fit[-1])
        if len(nodes) >= width - 1:
            break
    return kept


def tau(rows: list[dict], k: int, branches: int, width: int | None = None) -> float:
    emitted = cycles = 0
    for row in rows:
        out = row["output"]
        context, i = list(row["prompt_ids"]) + out[:1], 1  # the prefill gives the first token
        while i < len(out):
            drafts = continuations(context, k, branches)
            drafts = within(drafts, width) if width else drafts
            agreed = max((next((a for a, t in enumerate(d) if i + a >= len(out) or t != out[i + a]), len(d))
                          for d in drafts), default=0)
            n = min(agreed + 1, len(out) - i)
            context += out[i:i + n]
            i += n
            emitted, cycles = emitted + n, cycles + 1
    return emitted / cycles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=Path, default=Path("plain-270m.json"))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    rows = plain_outputs(args.outputs, args.max_new_tokens)
    groups = {name: [r for r in rows if r["set"] == name] for name in SETS} | {"all": rows}
    print("tau of B continuations, each of up to K tokens (no width limit)")
    print("set rows", *[f"K{k}B{b}" for k in (4, 7) for b in (1, 2, 3, 4)])
    for name, group in groups.items():
        print(name, len(group), *[f"{tau(group, k, b):.2f}" for k in (4, 7) for b in (1, 2, 3, 4)])
    print("all sets, a chain of K:", *[f"K{k} {tau(rows, k, 1):.2f}" for k in (3, 4, 5, 7, 11, 15)])
    for width in (5, 8, 16):
        print(f"all sets, a trie of B continuations within {width} verify rows:",
              *[f"B{b} {tau(rows, width - 1, b, width):.2f}" for b in (1, 2, 3, 4, 8)])


if __name__ == "__main__":
    main()
