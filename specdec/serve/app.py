"""`specdec serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one warm engine.

ModelServer loads the target, starts the scheduler (continuous batching, scheduler.py), warms the engine
up with two short generations, then serves from a thread: the CLI, the tests and the load generator all
start it the same way. Endpoints: POST /v1/completions and /v1/chat/completions (whole, or streamed as
server-sent events ending with `data: [DONE]`), GET /v1/models, /health and /metrics (Prometheus).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.errors import SpecdecError
from specdec.generate import StopCondition, check_context
from specdec.models.config import decode_width
from specdec.models.tokenizer import Tokenizer
from specdec.sampling import SamplingParams
from specdec.serve.api import (APIError, ChatCompletionRequest, CompletionRequest, GenerationRequest, ResponseShape,
                               usage)
from specdec.serve.metrics import CONTENT_TYPE, ServerMetrics
from specdec.serve.scheduler import Request, Scheduler, SpeculativeConfig, Update

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
CLIENT_GONE = 499  # nginx's status for a client that closed the connection first
# Idle seconds before the server closes a kept-alive connection. uvicorn's default (5) ties httpx's client-side expiry
# (5, the OpenAI client's transport): a client could then send on a connection the server is closing, and get
# "Server disconnected without sending a response" (seen once in CI). Longer than the clients', they close first.
KEEP_ALIVE_S = 30


@dataclass
class ServeConfig:
    target: Path | None = None  # None: the embedded Gemma 3 270M
    engine: str = "torch"
    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free port
    max_num_seqs: int = 8  # rows of the engine's batch
    max_model_len: int = 4096  # positions the KV cache holds per row
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    served_model_name: str | None = None  # None: the checkpoint directory's name
    dtype: str | None = None
    fp8: bool = False  # FP8 linears (specdec.models.fp8)
    compile: bool = True  # torch on CUDA: torch.compile the forward; JAX: prefill's own program (a server repays both)
    graph_prefill: bool = False  # torch, compiled on CUDA: prefill as CUDA graphs (TorchEngine's graph_prefill)
    cycles_per_call: int | None = None  # JAX: decode cycles a device call (None: the Scheduler's default)
    narrow_cycles: bool = True  # torch: cycles over the rows in use, at the widths that keep a row's bits (Scheduler)


class ModelServer:
    """A loaded target, its scheduler and the HTTP app. `start()` serves from a thread and returns the URL."""

    def __init__(self, config: ServeConfig):
        import specdec

        if config.max_num_seqs < 1:
            raise SpecdecError(f"--max-num-seqs must be >= 1, got {config.max_num_seqs}")
        if not 0 <= config.port < 65536:
            raise SpecdecError(f"--port must be in 0..65535, got {config.port}")
        if config.cycles_per_call is not None and config.cycles_per_call < 1:
            raise SpecdecError(f"--cycles-per-call must be >= 1, got {config.cycles_per_call}")
        width = decode_width(max(config.speculative.k, 1))
        if config.max_model_len <= width:
            raise SpecdecError(f"--max-model-len must be more than {width}, the positions a decode forward writes "
                               f"(k={config.speculative.k}), got {config.max_model_len}")
        check_can_listen(config.host, config.port)  # before the minutes of loading and warming up
        self.config = config
        drafter = config.speculative.source(config.target)  # its files checked against the target before loading
        self.target = specdec.load(config.target, engine=config.engine, dtype=config.dtype,
                                   k_max=max(config.speculative.k, 1), max_seq_len=config.max_model_len,
                                   batch=config.max_num_seqs, compile=config.compile, fp8=config.fp8,
                                   graph_prefill=config.graph_prefill, hidden_layers=drafter.taps)
        self.tokenizer: Tokenizer = self.target.tokenizer
        self.model_name = config.served_model_name or self.target.path.name
        self.device = device_name(self.target)
        self.created = int(time.time())
        self.scheduler = Scheduler(self.target.engine, config.speculative, config.cycles_per_call,
                                   config.narrow_cycles, drafter)
        self.metrics = ServerMetrics(self.scheduler, ENDPOINTS)
        self.app = create_app(self)
        self._http = None
        self._http_thread: threading.Thread | None = None

    def start(self) -> str:
        """Start decoding, warm the engine up (compiles, captures), then listen; -> the server's URL."""
        import uvicorn

        if self.target.engine_name == "torch":  # before the scheduler's thread owns the engine
            self.target.engine.warm_up_prefill()
        self.scheduler.start()
        self.warm_up()
        config = uvicorn.Config(self.app, host=self.config.host, port=self.config.port, log_level="warning",
                                access_log=False, timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S)
        self._http = uvicorn.Server(config)
        self._http_thread = threading.Thread(target=self._http.run, name="specdec-http", daemon=True)
        self._http_thread.start()
        while not self._http.started:
            if not self._http_thread.is_alive():
                self.scheduler.stop()
                raise SpecdecError(f"could not listen on {self.config.host}:{self.config.port}")
            time.sleep(0.01)
        port = self._http.servers[0].sockets[0].getsockname()[1]
        return f"http://{self.config.host}:{port}"

    def warm_up(self) -> None:
        """Short generations, greedy and sampled with each set of filters, so no request pays for compiling or
        capturing them: torch's cycle captures one graph per set; JAX compiles a greedy program and one for every
        mix of settings, whose filters run where a row uses them. On JAX, a stateful drafter's programs that start a row
        are compiled for every prompt length the context allows (an EAGLE-3 head's prefill: one per bucket)."""
        if self.target.engine_name == "jax":
            engine = self.target.engine
            self.scheduler.cycle.compile_row_starts(engine.max_seq_len - engine.width)
        prompt = self.tokenizer.encode("Hello")
        filters = {"top_k": 50, "top_p": 0.9, "min_p": 0.05}
        samplings = [SamplingParams()]
        for used in itertools.product((False, True), repeat=len(filters)):
            chosen = {name: value for (name, value), on in zip(filters.items(), used) if on}
            samplings.append(SamplingParams(temperature=1.0, seed=0, **chosen))
        for sampling in samplings:
            self.scheduler.generate(prompt, sampling, StopCondition(2))
        self.scheduler.reset_stats()

    def wait(self) -> None:
        """Serve until interrupted (Ctrl-C)."""
        try:
            self._http_thread.join()
        except KeyboardInterrupt:
            pass
        self.stop()

    def stop(self) -> None:
        if self._http is not None:
            self._http.should_exit = True
            self._http_thread.join()
        self.scheduler.stop()

    # -- requests ----------------------------------------------------------------------------------------

    def check_model(self, body: GenerationRequest) -> None:
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist (this server serves `{self.model_name}`)",
                           "model", "model_not_found")

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        vocab = self.target.engine.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}", "prompt")
        return list(prompt)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if not self.tokenizer.has_chat_template:
            raise APIError(400, f"`{self.model_name}` has no chat template (a base model): use /v1/completions",
                           "messages")
        text = self.tokenizer.apply_chat_template([m.as_template_input() for m in body.messages])
        return self.tokenizer.encode(text, add_bos=False)  # the template writes the BOS

    def job(self, body: GenerationRequest, prompt: list[int], max_tokens: int | None) -> "Job":
        """Check a request against the context and build its job (not submitted yet)."""
        if not prompt:
            raise APIError(400, "empty prompt", "prompt")
        engine = self.target.engine
        if max_tokens is None:  # as much as the context leaves
            max_tokens = max(engine.max_seq_len - engine.width + 1 - len(prompt), 1)
        try:
            check_context(engine, [prompt], max_tokens)
        except SpecdecError as e:
            raise APIError(400, str(e), "max_tokens", "context_length_exceeded") from None
        sampling = body.sampling(default_seed=random.randrange(2**63))
        stop = StopCondition(max_tokens, self.tokenizer.eos_ids, body.stop_strings, decode=self.tokenizer.decode)
        return Job(self.scheduler, self.tokenizer, prompt, sampling, stop)


def check_can_listen(host: str, port: int) -> None:
    """Bind `host`:`port` as uvicorn will (SO_REUSEADDR: a port left in TIME_WAIT is free), and let it go."""
    import socket

    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as e:  # socket.gaierror among them
        raise SpecdecError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None


def device_name(target) -> str:
    """What the engine runs on, for /health and benchmark records: "NVIDIA H100 80GB HBM3", "cpu", ..."""
    if target.engine_name == "jax":
        import jax

        return jax.devices()[0].device_kind
    if target.engine.device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(target.engine.device)
    return str(target.engine.device)


class TextStream:
    """A request's text as its tokens arrive: the final EOS left out, the text cut where a stop string
    starts, and a tail that could still become a stop string held back until it is decided."""

    def __init__(self, tokenizer: Tokenizer, stop: StopCondition):
        self.decoder = tokenizer.stream_decoder()
        self.stop = stop
        self.text = ""
        self.sent = 0
        self.stopped = False  # by EOS or a stop string, not by the token budget

    def push(self, tokens: list[int], finished: bool) -> str:
        if finished and tokens and tokens[-1] in self.stop.eos_ids:
            tokens, self.stopped = tokens[:-1], True
        self.text += self.decoder.push(tokens)
        if finished:
            self.text += self.decoder.flush()
        hits = [self.text.find(s) for s in self.stop.stop_strings if s in self.text]
        if hits:
            end, self.stopped = min(hits), True
        elif finished:
            end = len(self.text)
        else:
            end = len(self.text) - max((i for s in self.stop.stop_strings for i in range(1, len(s))
                                        if self.text.endswith(s[:i])), default=0)
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stopped else "length"


class Job:
    """One request seen from the HTTP side: submits it to the scheduler and yields its text as it comes.
    Leaving `deltas()` early (the client went away) cancels the request, which frees its row."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, prompt: list[int], sampling: SamplingParams,
                 stop: StopCondition):
        loop = asyncio.get_running_loop()
        self.updates: asyncio.Queue[Update] = asyncio.Queue()
        self.scheduler = scheduler
        self.request = Request(prompt, sampling, stop,
                               on_update=lambda update: loop.call_soon_threadsafe(self.updates.put_nowait, update))
        self.text = TextStream(tokenizer, stop)

    def usage(self, spec_decode: bool) -> dict:
        """The request's usage, with its spec_decode counts where it asked for them."""
        return usage(len(self.request.prompt), len(self.request.tokens),
                     self.request.stats.spec_decode_summary() if spec_decode else None)

    async def deltas(self) -> AsyncIterator[str]:
        self.scheduler.submit(self.request)
        finished = False
        try:
            while not finished:
                update = await self.updates.get()
                if update.error:
                    raise APIError(500, update.error)
                finished = update.finished
                delta = self.text.push(update.tokens, finished)
                if delta:
                    yield delta
        finally:
            if not finished:
                self.request.cancel()


def create_app(server: ModelServer) -> FastAPI:
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None)
    app.add_middleware(_CountRequests, metrics=server.metrics)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_, e: RequestValidationError):  # OpenAI answers 400 where FastAPI says 422
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            error = APIError(400, f"malformed JSON body: {first['ctx']['error']} (at character {first['loc'][-1]})")
            return JSONResponse(error.body(), status_code=400)
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        error = APIError(400, f"{where}: {first['msg']}" if where else first["msg"], where or None)
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(SpecdecError)
    async def bad_input(_, e: SpecdecError):  # the tokenizer's chat template, for one
        return JSONResponse(APIError(400, str(e)).body(), status_code=400)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        server.check_model(body)
        body.refuse_unsupported()
        job = server.job(body, server.completion_prompt(body), body.max_tokens)
        return await respond(job, body, ResponseShape(chat=False, model=server.model_name), http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        server.check_model(body)
        body.refuse_unsupported()
        job = server.job(body, server.chat_prompt(body), body.token_budget)
        return await respond(job, body, ResponseShape(chat=True, model=server.model_name), http)

    @app.get("/v1/models")
    async def models():
        engine = server.target.engine  # the last width - 1 positions are kept for drafts (generate.check_context)
        card = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "specdec",
                "max_model_len": engine.max_seq_len - engine.width + 1}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        s = server.scheduler
        return {"status": "ok", "running": s.running, "waiting": s.num_waiting, "max_num_seqs": len(s.rows),
                "engine": server.config.engine, "device": server.device, "cycles_per_call": s.cycles_per_call,
                "cycle_widths": list(s.cycle.widths),
                "speculative_config": server.config.speculative.as_json()}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE)

    return app


async def respond(job: Job, body: GenerationRequest, shape: ResponseShape, http: HTTPRequest):
    if body.stream:
        return StreamingResponse(_events(job, body, shape), media_type="text/event-stream")

    async def whole_text() -> str:
        async with aclosing(job.deltas()) as deltas:
            return "".join([delta async for delta in deltas])

    text = await _unless_client_leaves(http, whole_text())
    if text is None:
        return Response(status_code=CLIENT_GONE)
    return shape.whole(text, job.text.finish_reason, job.usage(body.spec_decode_stats))


async def _events(job: Job, body: GenerationRequest, shape: ResponseShape) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format. When the client disconnects, Starlette cancels this
    generator, and leaving job.deltas() cancels the request."""

    def event(data: dict) -> str:
        return f"data: {json.dumps(data)}\n\n"

    if shape.chat:
        yield event(shape.chunk("", role=True))
    try:
        async with aclosing(job.deltas()) as deltas:
            async for delta in deltas:
                yield event(shape.chunk(delta))
    except APIError as e:
        yield event(e.body())
        return
    yield event(shape.chunk(None if shape.chat else "", job.text.finish_reason))
    if body.include_usage:
        yield event(shape.usage_chunk(job.usage(body.spec_decode_stats)))
    yield "data: [DONE]\n\n"


async def _unless_client_leaves(http: HTTPRequest, work):
    """Await `work` unless the client disconnects first (then cancel it and return None)."""

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


class _CountRequests:
    """ASGI middleware counting responses by endpoint and status (streams included, as they start)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.count_request(scope["path"], message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
