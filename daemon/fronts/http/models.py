"""The HTTP gateway's request bodies as pydantic models: OpenAI's names and the fields only HTTP
has. A field the gateway hands on to a generate request is `Wire`: its type and bounds are the
request schema's (daemon/wire/schema.py), judged there once, as for the SDK.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

Wire = Any  # judged by daemon.wire.schema, with the protocol's texts, on both fronts alike


class _Body(BaseModel):
    # Fields other servers add are ignored; OpenAI fields we cannot honour are refused by name.
    model_config = ConfigDict(extra="ignore")


class _Part(_Body):
    type: str
    text: str | None = None


class _Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[_Part] | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class _StreamOptions(_Body):
    include_usage: bool = False


class Sampling(_Body):
    model: str
    max_tokens: Wire = None
    n: Wire = None
    temperature: Wire = None
    top_p: Wire = None
    stop: Wire = None
    seed: Wire = None  # -1: a fresh random seed (llama.cpp's clients send it)
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    user: Wire = None  # any string up to 256 characters (protocol.internal_user)
    frequency_penalty: Wire = None
    presence_penalty: Wire = None
    logit_bias: Wire = None
    # Extensions (send them with the client's extra_body).
    top_k: Wire = None
    ignore_eos: Wire = None
    adapter: Wire = None  # "latest" (default with `user`), "base", or a version
    record: Wire = None  # store the interaction for feedback (default: when `user` consented)
    speculation: Wire = None  # prompt-lookup speculative decoding: "auto", "on", "off" (docs/speculative.md)

    def unsupported(self) -> list[str]:
        """Known OpenAI parameters set to something this daemon cannot do."""
        return []


class ChatRequest(Sampling):
    messages: list[_Message]
    max_completion_tokens: Wire = None
    logprobs: bool | None = None
    top_logprobs: Wire = None
    tools: Wire = None
    tool_choice: Wire = None
    parallel_tool_calls: bool | None = None  # accepted: a forced call is one call; auto may give several
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: Wire = None
    # vLLM's prefill switches: by default a final assistant message is continued (as llama.cpp's
    # server does); continue_final_message=false or add_generation_prompt=true close it instead.
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    # Thinking models (docs/thinking.md): OpenAI's `reasoning_effort` ("none"/"minimal": off,
    # "low"/"medium"/"high": on) and vLLM's `chat_template_kwargs` ({"enable_thinking": bool}).
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        # The legacy function-calling fields: `tools` and `tool_choice` replace them.
        return [n for n in ("functions", "function_call") if getattr(self, n) not in (None, [], "none")]


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: Wire = None
    response_format: Wire = None  # extension: as for chat

    def unsupported(self) -> list[str]:
        bad = ["suffix"] if self.suffix else []
        if self.best_of not in (None, 1) and self.best_of != (self.n or 1):
            bad.append("best_of")
        return bad


class EmbeddingRequest(_Body):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None


class FeedbackRequest(_Body):
    model_config = ConfigDict(extra="forbid")
    id: str  # the completion id (= the daemon's interaction id)
    user: str
    kind: str  # choice, thumbs, rating or edit
    chosen: int | None = None
    candidate: int | None = None
    up: bool | None = None
    stars: int | None = None
    text: str | None = None


class ConsentRequest(_Body):
    granted: bool | None = None  # absent (and no `fleet`): grant, as before `fleet` existed
    fleet: bool | None = None

