"""The serving engine: continuous batching over separately jitted prefill and decode programs."""
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.request import Request, RequestOutput, SamplingParams, TokenEvent

__all__ = ["Engine", "EngineConfig", "Request", "RequestOutput", "SamplingParams", "TokenEvent"]
