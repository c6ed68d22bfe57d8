"""The OpenAI-compatible HTTP front door: a Starlette app that speaks the ZMQ protocol to the router."""
