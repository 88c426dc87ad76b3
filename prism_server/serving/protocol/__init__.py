"""The OpenAI wire protocol. Nothing else in the server knows the JSON shapes.

requests.py   request models (fields in the order of the OpenAI reference), their checks, and
              their conversion into `SamplingParams`; chat_requests.py: chat's and /tokenize's
responses.py  the error envelope, whole responses and stream chunks, usage, logprobs
"""

from __future__ import annotations

from prism_server.serving.protocol.chat_requests import ChatCompletionRequest, TokenizeRequest
from prism_server.serving.protocol.requests import CompletionRequest, DetokenizeRequest
from prism_server.serving.protocol.responses import (
    APIError,
    ChatShapes,
    CompletionShapes,
    LogprobFormatter,
    error_body,
    finish_reason,
    model_card,
    now,
    stream_error,
    token_bytes,
    usage,
    validation_error,
)

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatShapes",
    "CompletionRequest",
    "CompletionShapes",
    "DetokenizeRequest",
    "LogprobFormatter",
    "TokenizeRequest",
    "error_body",
    "finish_reason",
    "model_card",
    "now",
    "stream_error",
    "token_bytes",
    "usage",
    "validation_error",
]
