"""The `/v1/responses` request body as a pydantic model: its shape only (OpenAI's names and
types); what each field does, and the refusal of values this daemon cannot honour, is
`responses_api`'s; the values themselves are checked by `daemon.wire`, as for chat: a field handed
on to the generate request is `Wire` (not coerced here: `"5"` or `true` for an integer is refused
by the schema with chat's text, code and `param`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from daemon.fronts.http.models import Wire


class ResponsesRequest(BaseModel):
    # Fields other servers add are ignored; OpenAI fields we cannot honour are refused by name.
    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted: a forced call is one call; auto may give several
    text: dict[str, Any] | None = None  # {"format": {...}}: structured output
    max_output_tokens: Wire = None
    temperature: Wire = None
    top_p: Wire = None
    stream: bool | None = False
    store: bool | None = True  # OpenAI's default: kept for previous_response_id (in memory here)
    user: Wire = None
    metadata: dict[str, str] | None = None  # echoed back
    reasoning: dict[str, Any] | None = None  # effort turns a thinking model's switch; summary ignored
    include: list[str] | None = None  # accepted; no item we produce has optional parts
    truncation: str | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    conversation: Any = None
    prompt: Any = None
    # Extensions (send them with the client's extra_body), as on chat.
    seed: Wire = None
    stop: Wire = None
    top_k: Wire = None
    ignore_eos: Wire = None
    adapter: Wire = None
    record: Wire = None
    speculation: Wire = None

    def unsupported(self) -> list[str]:
        """Known OpenAI parameters set to something this daemon cannot do."""
        bad = []
        if self.background:
            bad.append("background")  # no queue of responses to poll: stream instead
        if self.truncation not in (None, "disabled"):
            bad.append("truncation")  # the context is never cut silently
        if self.top_logprobs:
            bad.append("top_logprobs")
        if self.conversation is not None:
            bad.append("conversation")  # use previous_response_id
        if self.prompt is not None:
            bad.append("prompt")  # stored prompt templates live on OpenAI's side
        return bad
