"""The compiler: Hugging Face frontend, pipeline driver, the `thinc` CLI."""

from .build import CompileReport, build, compile_model
from .config import CompileConfig, CompileOptionError

__all__ = ["CompileConfig", "CompileOptionError", "CompileReport", "build", "compile_model"]
