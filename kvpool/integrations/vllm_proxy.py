"""A prefill/decode proxy for vLLM engines that share a kvpool: one OpenAI-compatible endpoint
in front of ``kv_producer`` (prefill) and ``kv_consumer`` (decode) engines.

    python -m kvpool.integrations.vllm_proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

For each ``POST /v1/completions`` or ``/v1/chat/completions`` it sends the request to a
prefill engine with ``max_tokens`` 1 (not streamed), then the client's own request to a
decode engine with the ``kv_transfer_params`` the prefill engine answered (kvpool's
connector names there how many of the prompt's blocks it published, so the decode engine
waits for them instead of recomputing, at most its ``load_timeout_s``), and streams the
decode engine's answer back as it comes. Each step goes to the engine of its kind with the
fewest requests in flight. A prefill engine's error is the client's answer (nothing is sent
to decode); ``GET /v1/models`` and ``/health`` are answered by the engines behind.

Built on aiohttp, which vLLM brings; binds 127.0.0.1 unless ``--host`` says otherwise. It
holds no state beyond requests in flight, so several proxies may front the same engines.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

__all__ = ["Backend", "PdProxy", "main", "prefill_request"]

log = logging.getLogger("kvpool.vllm_proxy")

# Headers of the client's request passed on to the engines (an API key among them).
_PASSED_HEADERS = ("Authorization", "X-Request-Id")


@dataclass
class Backend:
    """One engine's OpenAI server: ``url`` (``http://host:port``) and its requests in flight."""

    url: str
    in_flight: int = field(default=0, compare=False)


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's copy of a client's request: one token, not streamed (the prompt's
    KV is what it is for), the client's ``kv_transfer_params`` kept."""
    prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    return prefill


class PdProxy:
    """The proxy's routes over ``prefill`` and ``decode`` engines (see the module docstring);
    ``timeout_s``: how long one engine call may take."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], timeout_s: float = 600.0) -> None:
        if not prefill or not decode:
            raise ValueError("a P/D proxy needs at least one prefill and one decode engine")
        self.prefill = [Backend(url.rstrip("/")) for url in prefill]
        self.decode = [Backend(url.rstrip("/")) for url in decode]
        self.timeout = ClientTimeout(total=timeout_s)
        self._session: ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _: web.Application) -> None:
        self._session = ClientSession(timeout=self.timeout)

    async def _close(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> ClientSession:
        assert self._session is not None, "the proxy's app has not started"
        return self._session

    @staticmethod
    def _pick(backends: list[Backend]) -> Backend:
        return min(backends, key=lambda b: b.in_flight)

    @staticmethod
    def _headers(request: web.Request) -> dict[str, str]:
        return {name: request.headers[name] for name in _PASSED_HEADERS if name in request.headers}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": {"message": "the request body is not JSON", "type": "BadRequest"}},
                                     status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "the request body must be a JSON object",
                                                "type": "BadRequest"}}, status=400)
        headers = self._headers(request)
        prefill = self._pick(self.prefill)
        prefill.in_flight += 1
        try:
            async with self.session.post(prefill.url + request.path, json=prefill_request(body),
                                         headers=headers) as answer:
                if answer.status != 200:  # the client sees the prefill engine's own error
                    return web.Response(status=answer.status, body=await answer.read(),
                                        content_type=answer.content_type)
                produced = await answer.json()
        except (TimeoutError, OSError) as exc:
            log.warning("prefill engine %s failed: %s", prefill.url, exc)
            return web.json_response({"error": {"message": f"prefill engine {prefill.url} failed: {exc}",
                                                "type": "BadGateway"}}, status=502)
        finally:
            prefill.in_flight -= 1
        params = produced.get("kv_transfer_params") if isinstance(produced, dict) else None
        decode_body = dict(body)
        if isinstance(params, dict):
            decode_body["kv_transfer_params"] = params
        decode = self._pick(self.decode)
        decode.in_flight += 1
        response: web.StreamResponse | None = None
        try:
            async with self.session.post(decode.url + request.path, json=decode_body, headers=headers) as answer:
                response = web.StreamResponse(status=answer.status)
                response.content_type = answer.content_type
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (TimeoutError, OSError) as exc:
            if response is not None and response.prepared:  # the stream began: nothing else can be sent
                # (most often the client hung up once it had its answer, before the last chunk)
                log.info("stream from decode engine %s ended early: %s", decode.url, exc)
                return response
            log.warning("decode engine %s failed: %s", decode.url, exc)
            return web.json_response({"error": {"message": f"decode engine {decode.url} failed: {exc}",
                                                "type": "BadGateway"}}, status=502)
        finally:
            decode.in_flight -= 1

    async def models(self, request: web.Request) -> web.Response:
        try:
            async with self.session.get(self.decode[0].url + "/v1/models", headers=self._headers(request)) as answer:
                return web.Response(status=answer.status, body=await answer.read(), content_type=answer.content_type)
        except (TimeoutError, OSError) as exc:
            return web.json_response({"error": {"message": str(exc), "type": "BadGateway"}}, status=502)

    async def health(self, _: web.Request) -> web.Response:
        """200 when every engine behind answers its own /health with 200, else 503 naming them."""
        down = []
        for backend in [*self.prefill, *self.decode]:
            try:
                async with self.session.get(backend.url + "/health", timeout=ClientTimeout(total=5)) as answer:
                    if answer.status != 200:
                        down.append(backend.url)
            except (TimeoutError, OSError):
                down.append(backend.url)
        return web.json_response({"down": down}, status=503 if down else 200)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpool.integrations.vllm_proxy",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a kv_producer engine's OpenAI server, e.g. http://127.0.0.1:8100 (repeat for more)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a kv_consumer engine's OpenAI server (repeat for more)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="how long one engine call may take")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    proxy = PdProxy(args.prefill, args.decode, args.timeout_s)
    log.info("P/D proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port,
             ", ".join(b.url for b in proxy.prefill), ", ".join(b.url for b in proxy.decode))
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
