"""The OpenAI-compatible HTTP server: `create_app(engine, model_name)` (Flask) served by waitress."""
from jaxserve.server.app import create_app

__all__ = ["create_app"]
