"""The HTTP API: OpenAI routes, protocol, metrics, deadlines, shutdown. No Ray."""
