"""blockdraft: an LLM inference engine built around DFlash speculative decoding."""

from blockdraft.config import EngineConfig, SpeculativeConfig
from blockdraft.llm import LLM
from blockdraft.outputs import CompletionOutput, RequestOutput
from blockdraft.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
]
