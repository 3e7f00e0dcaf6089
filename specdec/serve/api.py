"""The OpenAI API's shapes: request bodies, response and stream-chunk bodies, and errors.

Requests accept OpenAI's fields plus vLLM's sampling extensions (top_k, min_p). What specdec cannot do
(n > 1, echo, logprobs, penalties) is refused with a 400 rather than ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationRequest(BaseModel):
    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0)  # OpenAI's default: sampled
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # vLLM: 0 or -1 = off
    min_p: float = Field(0.0, ge=0, lt=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    spec_decode_stats: bool = False  # specdec's extension: the request's own spec_decode counts in its usage
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n}: only n=1 is supported", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported (it would change the target's distribution)", name)

    def sampling(self, default_seed: int) -> SamplingParams:
        """The request's sampling settings; a request without a seed gets `default_seed` (a random one)."""
        try:
            return SamplingParams(temperature=self.temperature, top_k=max(self.top_k, 0), top_p=self.top_p,
                                  min_p=self.min_p, seed=default_seed if self.seed is None else self.seed)
        except SpecdecError as e:
            raise APIError(400, str(e)) from None

    @property
    def stop_strings(self) -> list[str]:
        strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in strings):
            raise APIError(400, "stop strings must not be empty", "stop")
        return strings

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, gt=0)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported", "echo")
        if self.logprobs is not None:
            raise APIError(400, "logprobs are not supported", "logprobs")

    def single_prompt(self) -> str | list[int]:
        """The one prompt: text or token ids (a list of one of either is fine)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"{len(prompt)} prompts in one request: send one request per prompt", "prompt")
            prompt = prompt[0]
        return prompt


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)  # the newer name of max_tokens
    logprobs: bool = False

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", "logprobs")

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, spec_decode: dict | None = None) -> dict:
    """OpenAI's usage; with `spec_decode` (a request that asked for it), the request's speculative decoding
    counts as vLLM names them (SpecStats.spec_decode_summary)."""
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
              "total_tokens": prompt_tokens + completion_tokens}
    return counts if spec_decode is None else {**counts, "spec_decode": spec_decode}


class ResponseShape:
    """Bodies of one response, completion or chat, whole or as stream chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _body(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def whole(self, text: str, finish_reason: str, counts: dict) -> dict:
        """`counts`: the response's usage (api.usage)."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._body("chat.completion", [choice], usage=counts)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._body("text_completion", [choice], usage=counts)

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict:
        """A stream chunk: new text (the chat's first chunk also names the role), or the finish reason."""
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._body("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._body("text_completion", [choice])

    def usage_chunk(self, counts: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._body(obj, [], usage=counts)
