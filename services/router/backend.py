"""The HTTP side's backend: OpenAI requests in, mesh requests out.

Tokenizes (chat template or raw prompt), checks the context, fills the
sampling parameters (a seed is always drawn here, so prefill and decode sample
one reproducible stream), and relays the mesh's events as the OpenAI layer's.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from libs.engine.config import ModelConfig
from libs.engine.tokenizer import Tokenizer
from libs.tracing import mark_aborted, span
from pdmesh.v1 import common_pb2 as cpb
from services.router.core import Finished, MeshClient, MeshError, Progress, Tokens
from services.router.logprobs import LogprobText
from services.router.metrics import RouterMetrics
from services.router.openai_schema import (
    CompletionRequest,
    FinishEvent,
    RequestError,
    TokenEvent,
)


def operation_of(req: CompletionRequest) -> str:
    """The GenAI operation name of a request (its root span is `{operation} {model}`)."""
    return "chat" if req.kind == "chat" else "text_completion"


class MeshBackend:
    def __init__(
        self,
        model_id: str,
        config: ModelConfig,
        tokenizer: Tokenizer,
        mesh: MeshClient,
        metrics: RouterMetrics,
    ):
        self.model_id = model_id
        self.config = config
        self.tokenizer = tokenizer
        self.mesh = mesh
        self.metrics = metrics
        self.inflight = 0  # requests not yet finished, for Admin.Stats
        self.logprobs = LogprobText(tokenizer)

    def model_ids(self) -> list[str]:
        return [self.model_id]

    def is_healthy(self) -> tuple[bool, str]:
        return self.mesh.pairing.can_serve()

    def metrics_text(self) -> str:
        return self.metrics.text()

    def prompt_tokens(self, req: CompletionRequest) -> list[int]:
        if req.kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in req.messages or []]
            return self.tokenizer.apply_chat_template(messages)
        return self.tokenizer.encode(req.prompt or "")

    def sampling(self, req: CompletionRequest, prompt_len: int) -> cpb.SamplingParams:
        context = self.config.max_position
        if prompt_len >= context:
            raise RequestError(
                400,
                f"the prompt is {prompt_len} tokens; this model's context is {context}",
                param="messages" if req.kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        return cpb.SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed if req.seed is not None else secrets.randbits(63),
            max_tokens=min(req.max_tokens, context - prompt_len),
            stop=req.stop,
            ignore_eos=req.ignore_eos,
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs,
            prompt_logprobs=req.echo and req.logprobs,
        )

    async def stream(self, req: CompletionRequest) -> AsyncIterator[TokenEvent | FinishEvent]:
        if req.model not in self.model_ids():
            raise RequestError(
                404, f"model {req.model!r} does not exist", param="model", code="model_not_found"
            )
        prompt = self.prompt_tokens(req)
        if not prompt:
            raise RequestError(400, "the prompt is empty", param="prompt")
        sampling = self.sampling(req, len(prompt))
        # aclosing: closing this generator must close the mesh request in the same task
        # (its Aborts), not leave it to the garbage collector (see MeshClient.generate).
        run = self.run(prompt, sampling, operation_of(req), user=req.user)
        async with aclosing(run) as events:
            async for event in events:
                if isinstance(event, Finished):
                    yield FinishEvent(event.finish_reason, len(prompt), event.completion_tokens)
                else:
                    yield self._token_event(event, req, prompt)

    def _token_event(self, event: Tokens, req: CompletionRequest, prompt: list[int]) -> TokenEvent:
        token_id = event.token_ids[-1] if event.token_ids else -1
        if not req.logprobs:
            return TokenEvent(event.text, token_id)
        prompt_logprobs = None
        if event.prompt_logprobs is not None:  # the prompt's first token has no logprob
            first = self.logprobs.entry(prompt[0], None)
            prompt_logprobs = [first, *map(self.logprobs.described, event.prompt_logprobs)]
        logprobs = [self.logprobs.described(lp) for lp in event.logprobs]
        return TokenEvent(event.text, token_id, logprobs, prompt_logprobs)

    async def run(self, prompt: list[int], sampling: cpb.SamplingParams,
                  operation: str = "text_completion", budget: float | None = None,
                  user: str | None = None):
        """The mesh request with metrics and its root span (GenAI semantic conventions);
        shared by the HTTP and gRPC front ends."""
        attributes = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": self.model_id,
            "gen_ai.request.max_tokens": sampling.max_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.request.top_k": sampling.top_k,
            "gen_ai.usage.input_tokens": len(prompt),
        }
        if user:
            attributes["user.id"] = user  # the client's end user (OpenAI's `user`)
        with span(f"{operation} {self.model_id}", kind=SpanKind.SERVER,
                  attributes=attributes) as root:
            progress = Progress()
            finished = False
            try:
                async with aclosing(self._run(prompt, sampling, progress, budget)) as events:
                    async for event in events:
                        if isinstance(event, Finished):
                            finished = True
                            root.set_status(Status(StatusCode.OK))  # whatever ends us next
                            root.set_attribute("gen_ai.usage.output_tokens",
                                               event.completion_tokens)
                            root.set_attribute("gen_ai.response.finish_reasons",
                                               [event.finish_reason])
                        yield event
            except BaseException:
                # A client that hangs up right after the last token ends our handler by
                # cancellation too; the request itself was served.
                if not finished:
                    mark_aborted(root, progress.abort_reason or "client_disconnect",
                                 progress.stage)
                raise
            finally:
                root.set_attribute("pdmesh.request.id", progress.room)
                if progress.preemptions:
                    root.set_attribute("pdmesh.preemptions", progress.preemptions)

    async def _run(self, prompt: list[int], sampling: cpb.SamplingParams, progress: Progress,
                   budget: float | None):
        started = last = time.perf_counter()
        first = True
        self.inflight += 1
        self.metrics.inflight.inc()
        outcome = "client_disconnect"
        try:
            async with aclosing(
                self.mesh.generate(prompt, sampling, budget=budget, progress=progress)
            ) as events:
                async for event in events:
                    now = time.perf_counter()
                    if first:
                        self.metrics.ttft.observe(now - started)
                        first = False
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                    if isinstance(event, Finished):
                        outcome = "ok"
                    yield event
            outcome = "ok"
        except MeshError as e:
            outcome = "error"
            if first and e.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RequestError(504, f"the request's deadline passed: {e}",
                                   type="timeout") from e
            if first and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise RequestError(429, f"the mesh is full: {e}", type="rate_limit_exceeded",
                                   retry_after=e.retry_after) from e
            if first and e.code == grpc.StatusCode.OUT_OF_RANGE:  # larger than a whole pool
                raise RequestError(400, f"the request cannot fit: {e}", param="max_tokens",
                                   code="kv_pool_exceeded") from e
            if first:
                raise RequestError(503, f"the mesh failed: {e}", type="service_unavailable",
                                   retry_after=e.retry_after) from e
            raise
        finally:
            self.inflight -= 1
            self.metrics.inflight.dec()
            self.metrics.outcome(outcome)
            if outcome != "ok":
                self.metrics.abort(progress.abort_reason or "client_disconnect")
