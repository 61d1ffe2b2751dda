"""The OpenAI-compatible HTTP server: protocol, engine loop, endpoint handlers and the app."""
