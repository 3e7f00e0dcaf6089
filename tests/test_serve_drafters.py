"""`specdec serve` with each drafter kind that has files of its own (an EAGLE-3 head, a model drafter, a Gemma 4
MTP assistant), on both engines, through the OpenAI client: `--speculative-config` in vLLM's spelling; greedy
completions and chats equal to `specdec.generate` with the same drafter; the drafter drafting (the request's own
counts in its usage, the server's in /metrics, under vLLM's names); a seeded sampled request reproducing beside
another. Tiny random checkpoints with a character tokenizer of their 512-token vocabulary."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import specdec
from specdec.drafters import registry as drafter_registry
from specdec.models.random_init import write_random_assistant
from specdec.serve.app import ModelServer, ServeConfig
from specdec.bench.serve_load import scrape_metrics
from specdec.serve.scheduler import SpeculativeConfig
from tests.checkpoints import tiny_eagle3_head, write_ascii_tokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
            "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
PROMPTS = ["def fibonacci(n):", "a b a b a b a b a b", "Once upon a time"]
K = 3
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def setups(random_checkpoints, tmp_path_factory):
    """kind -> (target directory, the drafter's directory): a Gemma 3 target with an EAGLE-3 head and a Gemma 4
    E drafter; a Gemma 4 E target with its MTP assistant. Each with the character tokenizer and a chat template."""
    root = tmp_path_factory.mktemp("serve-drafters")

    def target(variant):
        out = root / f"target-{variant}"
        shutil.copytree(random_checkpoints[variant], out)
        return write_ascii_tokenizer(out, 512, {"chat_template": TEMPLATE})

    gemma3, gemma4 = target("gemma3"), target("gemma4_e")
    drafter = write_ascii_tokenizer(shutil.copytree(random_checkpoints["gemma4_e"], root / "drafter"), 512)
    return {"eagle3": (gemma3, tiny_eagle3_head(gemma3, root / "head", draft_vocab_size=256, stride=1)),
            "peagle": (gemma3, tiny_eagle3_head(gemma3, root / "phead", draft_vocab_size=256, stride=1, mask_token_id=0)),
            "model": (gemma3, drafter),
            "mtp": (gemma4, write_random_assistant("gemma4_e", root / "assistant", seed=3)),
            "ngram+peagle": (gemma3, root / "phead")}


KINDS = ["eagle3", "peagle", "model", "mtp", "ngram+peagle"]


def speculative_config(kind: str, drafter_dir) -> dict:
    """--speculative-config as vLLM spells it for our drafter kind (e.g. peagle: eagle3 with parallel_drafting)."""
    entry = drafter_registry.KINDS[kind]
    return {"method": entry.vllm_method, **dict(entry.vllm_flags), "model": str(drafter_dir), "num_speculative_tokens": K}


@pytest.mark.parametrize("engine", ["torch", "jax"])
@pytest.mark.parametrize("kind", KINDS)
def test_served_drafter_answers_as_generate_does(setups, kind, engine):
    target_dir, drafter_dir = setups[kind]
    config = speculative_config(kind, drafter_dir)
    server = ModelServer(ServeConfig(target=target_dir, engine=engine, port=0, max_num_seqs=2, max_model_len=128,
                                     speculative=SpeculativeConfig.from_json(json.dumps(config)), compile=False))
    url = server.start()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        row_start_programs = row_start_program_count(server)

        def complete(prompt, **kwargs):
            return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, **kwargs)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # 3 requests on 2 rows: one joins a row another left
            served = list(pool.map(lambda p: complete(p, temperature=0, extra_body={"spec_decode_stats": True}),
                                   PROMPTS))
        messages = [{"role": "user", "content": "Say hello."}]
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)

        spec = f"{kind}={drafter_dir}"
        loaded = specdec.load(target_dir, engine=engine, k_max=K, hidden_layers=specdec.api.drafter_taps(spec, target_dir))
        expected = [specdec.generate(p, loaded, drafter=spec, k=K, max_new_tokens=MAX_TOKENS)[0][0] for p in PROMPTS]
        assert [r.choices[0].text for r in served] == expected
        expected_chat, _ = specdec.generate(messages[0]["content"], loaded, drafter=spec, k=K,
                                            max_new_tokens=MAX_TOKENS, chat=True)
        assert chat.choices[0].message.content == expected_chat[0]

        counts = [r.usage.model_extra["spec_decode"] for r in served]
        assert all(c["num_drafts"] > 0 and c["num_draft_tokens"] == K * c["num_drafts"] for c in counts)
        assert all(sum(c["num_accepted_tokens_per_pos"]) == c["num_accepted_tokens"] <= c["num_draft_tokens"]
                   for c in counts)
        metrics = scrape_metrics(url)
        assert metrics[("specdec:spec_decode_num_draft_tokens_total", ())] >= sum(c["num_draft_tokens"] for c in counts)

        # A seeded sampled request draws the same tokens alone and beside a greedy one (lossless either way: the
        # drafts are the drafter's argmax, a point mass to the acceptance rule).
        alone = complete(PROMPTS[2], temperature=1.0, seed=7).choices[0].text
        with ThreadPoolExecutor(2) as pool:
            beside = pool.submit(complete, PROMPTS[2], temperature=1.0, seed=7)
            pool.submit(complete, PROMPTS[0], temperature=0)
        assert beside.result().choices[0].text == alone

        # The warm-up compiled the programs that start a row for every prompt length: a long prompt compiles none.
        complete("x" * 100, temperature=0)
        assert row_start_program_count(server) == row_start_programs
    finally:
        server.stop()


def row_start_program_count(server) -> int | None:
    """Programs the JAX EAGLE-3 head has compiled to start rows (one per prompt bucket: 16, 32, 64 and 128 tokens at
    this context of 128, P-EAGLE alike); None for any other drafter or engine."""
    from specdec.drafters.eagle3_jax import JaxEagle3

    head = server.scheduler.cycle.draft_fn
    if not isinstance(head, JaxEagle3):
        return None
    assert head._start._cache_size() == 4
    return head._start._cache_size()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_a_compiled_cuda_server_with_a_drafter_gives_plain_decodings_tokens(setups, kind):
    """What `specdec serve` runs on a GPU: bf16, compiled, each cycle one CUDA graph replay with the drafter's steps
    captured in it. Requests that join and leave a 2-row server get the tokens the same engine gives them decoding
    plainly."""
    from specdec.drafters.registry import DrafterSource
    from specdec.generate import StopCondition
    from specdec.sampling import SamplingParams
    from specdec.serve.scheduler import Scheduler

    target_dir, drafter_dir = setups[kind]
    source = DrafterSource(f"{kind}={drafter_dir}", target_dir)
    target = specdec.load(target_dir, k_max=K, batch=2, max_seq_len=128, compile=True, hidden_layers=source.taps)
    assert target.engine.use_graphs
    prompts = [target.tokenizer.encode(p) for p in PROMPTS]

    def served(speculative, drafter):
        scheduler = Scheduler(target.engine, speculative, source=drafter)
        scheduler.start()
        try:
            with ThreadPoolExecutor(len(prompts)) as pool:  # 3 requests on 2 rows
                tokens = list(pool.map(lambda p: scheduler.generate(p, SamplingParams(), StopCondition(24)), prompts))
            return tokens, scheduler.stats
        finally:
            scheduler.stop()

    plain, _ = served(SpeculativeConfig(), None)
    drafted, stats = served(SpeculativeConfig.from_json(json.dumps(speculative_config(kind, drafter_dir))), source)
    assert drafted == plain and stats.drafted > 0


@pytest.mark.parametrize("config, needle", [
    ({"method": "eagle3", "num_speculative_tokens": 3}, '"model"'),
    ({"method": "mtp", "model": "/nonexistent", "num_speculative_tokens": 3}, "/nonexistent"),
    ({"method": "draft_model", "model": "DIR", "num_speculative_tokens": 0}, "num_speculative_tokens >= 1"),
    ({"method": "ngram", "model": "DIR", "num_speculative_tokens": 3}, "unknown keys ['model']"),
    ({"method": "eagle3", "model": "DIR", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
])
def test_bad_speculative_configs_are_one_line_errors(config, needle, tmp_path):
    from tests.test_cli import one_line_error, run

    text = json.dumps(config).replace('"DIR"', json.dumps(str(tmp_path)))
    code, _, err = run("serve", "--speculative-config", text)
    one_line_error(code, err, needle)
