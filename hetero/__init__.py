"""hetero: fast long-context hybrid LLM inference (Qwen3.5 / Qwen3-Next) on Apple Silicon.

    engine = hetero.load()                      # the bundled model; or a directory / hub id
    result = engine.generate("def fib(n):", max_tokens=64)
    print(result.text, result.stats)
"""

from hetero import version as _version
from hetero.host import blas as _blas

_blas.apply()  # Linux: the wheel's fast BLAS under MLX; must come before anything imports mlx.core

# The public names load on first use (PEP 562), so a process that needs one module of the package (the ANE lane's
# worker: `python -m hetero.coreml.backends.ane_worker`) does not import the whole engine, MLX included.
_PUBLIC = {
    "STOP": "hetero.decode.request", "Finished": "hetero.decode.request", "GenerationRequest": "hetero.decode.request",
    "Prefilled": "hetero.decode.request", "Token": "hetero.decode.request",
    "Engine": "hetero.engine", "GenerationResult": "hetero.engine", "load": "hetero.engine",
    "HeteroError": "hetero.errors",
    "GenerationResponse": "hetero.library", "generate": "hetero.library", "load_prompt_cache": "hetero.library",
    "prefill": "hetero.library", "save_prompt_cache": "hetero.library", "stream_generate": "hetero.library",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    """A public name (imported from its module on first use) or a submodule (`hetero.pipeline`)."""
    import importlib

    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"hetero.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"hetero.{name}":
            raise
        raise AttributeError(f"module 'hetero' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__version__ = _version.__version__  # one place: hetero/version.py
