"""hetero: fast long-context hybrid LLM inference (Qwen3.5 / Qwen3-Next) on Apple Silicon.

    engine = hetero.load()                      # the bundled model; or a directory / hub id
    result = engine.generate("def fib(n):", max_tokens=64)
    print(result.text, result.stats)
"""

from hetero import blas as _blas

_blas.apply()  # Linux: the wheel's fast BLAS under MLX; must come before anything imports mlx.core

from hetero.decode.request import STOP, Finished, GenerationRequest, Prefilled, Token
from hetero.engine import Engine, GenerationResult, load
from hetero.errors import HeteroError
from hetero.library import GenerationResponse, generate, load_prompt_cache, prefill, save_prompt_cache, stream_generate

__all__ = [
    "STOP", "Engine", "Finished", "GenerationRequest", "GenerationResponse", "GenerationResult", "HeteroError", "Prefilled",
    "Token", "generate", "load", "load_prompt_cache", "prefill", "save_prompt_cache", "stream_generate",
]
__version__ = "0.1.0"
