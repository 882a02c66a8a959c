"""Stand-in for vllm/__init__.py: the version only. The real one imports
vllm.env_override, which imports torch and patches it."""

from .version import __version__, __version_tuple__  # noqa: F401
