"""A stand-in HTTP server for tests: an aiohttp app on 127.0.0.1, on a free port."""

from aiohttp import web


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """Start `app`; returns its runner (`await runner.cleanup()` stops it) and its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
