"""The HTTP server: aiohttp app, OpenAI routes, protocol, admin auth, metrics."""
