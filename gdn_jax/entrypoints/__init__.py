"""Entry points: the command line and the OpenAI-compatible server."""
