"""`specdec serve` through the official OpenAI client against real uvicorn servers (in threads, on free
ports) on a tiny random checkpoint with the real tokenizer: completions and chat, whole and streamed;
concurrent requests in one continuous batch equal to their solo runs; a seeded request reproducing in any
batch; bad requests answered with OpenAI's error JSON; disconnecting clients freeing their rows; metrics."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from specdec.serve.app import ModelServer, ServeConfig
from specdec.bench.serve_load import LoadSettings, run_load_apart, scrape_metrics as metrics
from specdec.serve.scheduler import JAX_CYCLES_PER_CALL, SpeculativeConfig
from tests.checkpoints import with_real_tokenizer

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                 "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "1, 2, 3, 4, 5,", "Once upon a time, in a land far away,",
           "import numpy as np\n", "a b a b a b a b"]
MAX_TOKENS = [8, 12, 16, 10, 14, 6]


def tiny_checkpoint(random_checkpoints, directory, chat_template: str | None):
    """The random gemma3 checkpoint with the real model's tokenizer and the given chat template (None: none)."""
    out = with_real_tokenizer(random_checkpoints["gemma3"], directory)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return out


def start_server(config: ServeConfig):
    server = ModelServer(config)
    url = server.start()
    return server, url


@pytest.fixture(scope="module")
def served(random_checkpoints, tmp_path_factory):
    """A torch server: 4 rows, n-gram drafting with k = 4, a 256-token context. -> (server, url)."""
    ckpt = tiny_checkpoint(random_checkpoints, tmp_path_factory.mktemp("serve") / "tiny-chat", CHAT_TEMPLATE)
    server, url = start_server(ServeConfig(
        target=ckpt, port=0, max_num_seqs=4, max_model_len=256,
        speculative=SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4}')))
    yield server, url
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0)


def complete(client, prompt: str, max_tokens: int, **kwargs):
    return client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=max_tokens, **kwargs)


def test_models_and_health(served, client):
    server, url = served
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    health = httpx.get(url + "/health").json()
    widths = health.pop("cycle_widths")  # those of 1, 2 and 4 rows whose forward keeps a row's bits on this CPU
    assert widths[-1] == 4 and set(widths) <= {1, 2, 4}
    assert health == {"status": "ok", "running": 0, "waiting": 0, "max_num_seqs": 4, "engine": "torch",
                      "device": "cpu", "cycles_per_call": 1,
                      "speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}


def test_completion_whole_and_streamed(client):
    whole = complete(client, PROMPTS[0], 10, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (7, 10, 17)

    chunks = list(complete(client, PROMPTS[0], 10, temperature=0, stream=True,
                           stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10

    # A stop string ends the text where it starts, with finish_reason "stop".
    stop = choice.text[3:6]
    stopped = complete(client, PROMPTS[0], 10, temperature=0, stop=[stop]).choices[0]
    assert (stopped.text, stopped.finish_reason) == (choice.text[: choice.text.index(stop)], "stop")
    streamed = complete(client, PROMPTS[0], 10, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == stopped.text


def test_chat_whole_and_streamed(client):
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6, temperature=0)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    # the prompt is the rendered template: <bos><start_of_turn>user\nSay hello.<end_of_turn>\n<start_of_turn>model\n
    assert whole.usage.prompt_tokens > 8 and whole.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_concurrent_greedy_requests_equal_their_solo_runs(client):
    solo = [complete(client, p, n, temperature=0).choices[0].text for p, n in zip(PROMPTS, MAX_TOKENS)]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # 6 requests on 4 rows: two wait for a free row
        together = list(pool.map(lambda args: complete(client, *args, temperature=0).choices[0].text,
                                 zip(PROMPTS, MAX_TOKENS)))
    assert together == solo


def test_a_seeded_sampled_request_reproduces_whatever_shares_the_batch(client):
    def sampled(seed):
        return complete(client, PROMPTS[1], 12, temperature=0.9, seed=seed, extra_body={"top_k": 40}).choices[0].text

    alone = sampled(7)
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(complete, client, PROMPTS[2], 16, temperature=0),
                  pool.submit(sampled, 8),
                  pool.submit(complete, client, PROMPTS[3], 10, temperature=1.0, top_p=0.9)]
        mine = pool.submit(sampled, 7)
        [f.result() for f in others]
    assert mine.result() == alone
    assert sampled(8) != alone  # another seed, another text


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served, client):
    url = served[1] + "/v1/completions"
    ok = {"model": "tiny-chat", "prompt": "Hi", "max_tokens": 2}
    assert error_of(httpx.post(url, content=b'{"prompt": "Hi",', headers={"content-type": "application/json"}),
                    400)["message"].startswith("malformed JSON")
    assert error_of(httpx.post(url, json={**ok, "model": "gpt-4"}), 404)["code"] == "model_not_found"
    assert error_of(httpx.post(url, json={**ok, "prompt": "word " * 300}), 400)["code"] == "context_length_exceeded"
    assert error_of(httpx.post(url, json={**ok, "max_tokens": 250}), 400)["code"] == "context_length_exceeded"
    for bad in ({"max_tokens": 0}, {"max_tokens": -3}, {"n": 2}, {"echo": True}, {"temperature": -1},
                {"prompt": ["a", "b"]}, {"prompt": [5, 10**9]}, {"stop": [""]}, {"prompt": None}):
        error_of(httpx.post(url, json={**ok, **bad}), 400)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-chat", messages=[], max_tokens=2)
    assert error_of(httpx.get(served[1] + "/v1/nothing"), 404)

    assert complete(client, "Hi", 3, temperature=0).usage.completion_tokens == 3
    assert metrics(served[1])[("specdec_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))] >= 10


def test_the_advertised_context_fits(served, client):
    """/v1/models' max_model_len is what a request's prompt and completion can take together: the positions kept for
    drafts (7 of the 256 at k = 4) are not advertised."""
    url = served[1]
    max_model_len = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    assert max_model_len == 256 - 7
    prompt = [2] + [10] * 9
    fits = complete(client, prompt, max_model_len - len(prompt), temperature=0)
    assert fits.usage.prompt_tokens + fits.usage.completion_tokens <= max_model_len
    too_long = {"prompt": prompt, "max_tokens": max_model_len - len(prompt) + 1}
    assert error_of(httpx.post(url + "/v1/completions", json=too_long), 400)["code"] == "context_length_exceeded"


def wait_for_free_rows(url: str, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while httpx.get(url + "/health").json()["running"] != 0:
        assert time.monotonic() < deadline, "a disconnected client's request still holds its row"
        time.sleep(0.05)


def test_a_client_leaving_frees_its_row(served, client):
    url = served[1]
    generated = metrics(url)[("specdec_generation_tokens_total", ())]
    stream = complete(client, PROMPTS[4], 240, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert httpx.get(url + "/health").json()["running"] == 1
    stream.close()
    wait_for_free_rows(url)

    # The same for a whole (non-streamed) request whose client gives up waiting.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[4], "max_tokens": 240, "temperature": 0},
                   timeout=httpx.Timeout(5.0, read=0.5))
    wait_for_free_rows(url)
    assert metrics(url)[("specdec_generation_tokens_total", ())] - generated < 2 * 240
    assert complete(client, PROMPTS[0], 4, temperature=0).usage.completion_tokens == 4


def test_metrics_report_tau_and_acceptance_per_position(served, client):
    complete(client, "a b c d a b c d a b c d a b", 24, temperature=0)
    m = metrics(served[1])
    cycles, emitted = m[("specdec_verify_cycles_total", ())], m[("specdec_emitted_tokens_total", ())]
    assert cycles > 0 and m[("specdec_tau", ())] == pytest.approx(emitted / cycles) and emitted >= cycles
    drafted = [m[("specdec_drafted_tokens_per_pos_total", (("position", str(i)),))] for i in range(4)]
    accepted = [m[("specdec:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
                for i in range(4)]
    rates = [m[("specdec_acceptance_per_pos", (("position", str(i)),))] for i in range(4)]
    assert drafted[0] > 0 and all(a <= d for a, d in zip(accepted, drafted))
    # vLLM's spec_decode counters: cycles that drafted, their draft tokens, the accepted ones
    assert m[("specdec:spec_decode_num_drafts_total", ())] == drafted[0]
    assert m[("specdec:spec_decode_num_draft_tokens_total", ())] == sum(drafted)
    assert m[("specdec:spec_decode_num_accepted_tokens_total", ())] == sum(accepted)
    assert rates == pytest.approx([a / d if d else 0.0 for a, d in zip(accepted, drafted)])
    assert emitted - cycles == sum(accepted)  # tau - 1 = accepted drafts per cycle
    assert m[("specdec_prompt_tokens_total", ())] > 0 and m[("specdec_generation_tokens_total", ())] > 0
    assert m[("specdec_num_requests_running", ())] == 0 and m[("specdec_num_requests_waiting", ())] == 0
    assert m[("specdec_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] >= 1


def test_the_load_generator_reports_each_concurrency(served):
    """From a process of its own, as bench_serve runs it beside an in-process server."""
    record = run_load_apart(LoadSettings(url=served[1], prompts=PROMPTS, concurrencies=(1, 3), requests_per_client=2,
                                         max_tokens=4))
    assert [(level["concurrency"], level["requests"]) for level in record["levels"]] == [(1, 2), (3, 6)]
    assert all(level["tokens"] == 4 * level["requests"] and level["tokens_per_s"] > 0 and level["tau"] >= 1
               for level in record["levels"])
    for level in record["levels"]:  # per token after the first: under a request's whole latency over its tokens
        assert 0 < level["tpot_p50_s"] < level["latency_p50_s"] / 3
        # vLLM's acceptance length counts only the cycles that drafted, tau every cycle: never below tau
        assert level["acceptance_length"] is None or level["acceptance_length"] >= level["tau"]
    assert record["device"] == "cpu" and record["model"] == "tiny-chat" and record["date"]
    assert record["cycle_widths"] == httpx.get(served[1] + "/health").json()["cycle_widths"]


@pytest.mark.parametrize("cycles_per_call", [1, None])  # None: the JAX server's default
def test_jax_engine_serves_plain_decoding_and_refuses_chat_without_a_template(random_checkpoints, tmp_path,
                                                                               cycles_per_call):
    ckpt = tiny_checkpoint(random_checkpoints, tmp_path / "tiny-base", chat_template=None)
    server, url = start_server(ServeConfig(target=ckpt, engine="jax", port=0, max_num_seqs=2, max_model_len=128,
                                           cycles_per_call=cycles_per_call))
    try:
        assert httpx.get(url + "/health").json()["cycles_per_call"] == (cycles_per_call or JAX_CYCLES_PER_CALL)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        whole = client.completions.create(model="tiny-base", prompt=PROMPTS[0], max_tokens=6, temperature=0)
        streamed = client.completions.create(model="tiny-base", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                             stream=True)
        assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
        assert whole.usage.completion_tokens == 6
        response = httpx.post(url + "/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert "no chat template" in error_of(response, 400)["message"]
    finally:
        server.stop()


@pytest.mark.parametrize("flags, needle", [
    (["--speculative-config", "{nope"], "not JSON"),
    (["--speculative-config", '{"method": "eagle"}'], "unknown method"),
    (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "k": 1}'], "unknown keys"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--cycles-per-call", "0"], "--cycles-per-call must be >= 1"),
    (["--engine", "tensorflow"], "unknown engine"),
    (["--target", "/nonexistent"], "not a checkpoint directory"),
])
def test_bad_flags_are_one_line_errors(flags, needle):
    from tests.test_cli import one_line_error, run

    code, _, err = run("serve", *flags)
    one_line_error(code, err, needle)


def test_the_vllm_peer_server_drafts_as_ours_and_fails_in_one_line(tmp_path):
    """`bench_serve.py --peer vllm`: our --speculative-config becomes vLLM's (n-gram's lookup sizes ours, EAGLE-3 on
    its Transformers backend), a hybrid is refused, and a server that cannot start is an error quoting its log."""
    from specdec.bench.serve_load import VllmServer
    from specdec.errors import SpecdecError

    def command(spec):
        return VllmServer(tmp_path / "m270", spec, 16, 2048, tmp_path / "log").command

    ngram = command({"method": "ngram", "num_speculative_tokens": 4})
    config = json.loads(ngram[ngram.index("--speculative-config") + 1])
    assert config == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert "--model-impl" not in ngram and ngram[ngram.index("--max-num-seqs") + 1] == "16"
    eagle3 = command({"method": "eagle3", "model": "/h", "num_speculative_tokens": 5})
    assert eagle3[eagle3.index("--model-impl") + 1] == "transformers"
    assert "--speculative-config" not in command(None)
    with pytest.raises(SpecdecError, match="ngram_first"):
        command({"method": "eagle3", "model": "/h", "num_speculative_tokens": 4, "ngram_first": True})
    server = VllmServer(tmp_path / "m270", None, 4, 256, tmp_path / "log")
    server.command = [sys.executable, "-c", "import sys; print('no GPU here'); sys.exit(3)"]
    with pytest.raises(SpecdecError, match="exited before it answered: no GPU here"):
        server.start(timeout_s=60)
