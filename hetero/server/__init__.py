"""OpenAI- and Anthropic-compatible HTTP server (Starlette on uvicorn) over one `Engine`.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (OpenAI Responses), POST /v1/messages and
/v1/messages/count_tokens (Anthropic), GET /v1/models (in the shape of the API the request speaks), GET /health,
GET /metrics (Prometheus); any
other route or method is a 404 / 405 in that API's error shape.
Every response reports cached prompt tokens (OpenAI `usage.prompt_tokens_details.cached_tokens`, Anthropic
`usage.cache_read_input_tokens`) and engine stats in a `hetero` field; a bad request gets a 4xx JSON error that
names the field.

Modules, in the order a request meets them:
  app.py        ServerSettings, create_app (routes, access log), serve, bind, open_session_store
  common.py     the key check, the body limit, one path from Job to response (JSON or SSE) and for errors
  refusals.py   RequestError, and `refusing`: the one boundary where a decoder's failure on client bytes is a 400
  requests.py   body JSON and field checks, the Parser (template + tokenizer, model aliases), the Job
  images.py     image parts: read, base64-decoded and decoded while the request is parsed
  defaults.py   sampling defaults from generation_config.json; fields not implemented yet, refused by name
  openai.py     OpenAI chat / completions: parse_chat, parse_completion, ChatOutput, CompletionOutput
  responses.py  OpenAI Responses, request side: input items -> chat messages, the ResponseStore
  responses_output.py  OpenAI Responses, output side: the response object and its event stream
  anthropic.py  Anthropic messages: parse_messages, MessagesOutput, count_tokens, the models page
  toolcalls.py  messages, tools and tool_choice through the chat template; the reply split into text, reasoning, calls
  runner.py     the Runner: jobs on worker threads taking turns on the model between their jobs (Started, text,
                Outcome)
  stops.py      exact stop strings over streamed text
  metrics.py    GET /metrics: a registry per server, vLLM's names (finished requests' counters, live gauges)
  stopping.py   SIGTERM / SIGINT: no new requests, jobs end with a final event, exit within 5 s
"""

from hetero.server.app import ServerSettings, bind, create_app, open_session_store, serve
from hetero.server.requests import DEFAULT_MAX_TOKENS, Job, Parser, parse_body
from hetero.server.refusals import RequestError
from hetero.server.runner import Cancelled, Outcome, Runner, Started
from hetero.server.stops import StopMatcher

__all__ = ["DEFAULT_MAX_TOKENS", "Cancelled", "Job", "Outcome", "Parser", "RequestError", "Runner", "ServerSettings",
           "Started", "StopMatcher", "bind", "create_app", "open_session_store", "parse_body", "serve"]
