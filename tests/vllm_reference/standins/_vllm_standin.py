"""Machinery shared by the stand-in modules (this file is copied into every import root).

An *inert* module answers every attribute with a placeholder class: a module that vLLM
imports only to name types in annotations, subclass, or call at import time can be an
inert stand-in. Placeholders are classes (subclassable, usable in ``X | None`` and in
``isinstance``); calling one gives an instance that is falsy, callable, iterable as empty
and answers attributes with more placeholders. Code that really *uses* a stand-in's
results is outside what these stand-ins support: give it a real stand-in instead.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):  # protocols (msgspec's probes...)
            raise AttributeError(name)
        return placeholder(f"{cls.__qualname__}.{name}", cls.__module__)

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __repr__(cls) -> str:
        return f"<stand-in {cls.__module__}.{cls.__qualname__}>"


class Placeholder(metaclass=_PlaceholderMeta):
    """Base of every placeholder class; instances are inert."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return placeholder(name, type(self).__module__)()

    def __bool__(self) -> bool:
        return False

    def __iter__(self) -> Any:
        return iter(())

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def placeholder(name: str, module: str) -> type[Placeholder]:
    """A fresh placeholder class named ``name`` that claims to live in ``module``."""
    cls = _PlaceholderMeta(name.rsplit(".", 1)[-1], (Placeholder,), {"__module__": module})
    cls.__qualname__ = name
    return cls


def make_inert(module: types.ModuleType) -> None:
    """Turn ``module`` into an inert one: unknown attributes become placeholder classes."""
    cache: dict[str, Any] = {}

    def __getattr__(name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name not in cache:
            cache[name] = placeholder(name, module.__name__)
        return cache[name]

    module.__getattr__ = __getattr__  # type: ignore[method-assign]


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every submodule of an inert package as an inert module."""

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith(self.package + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        make_inert(module)


def inert_package(module: types.ModuleType) -> None:
    """Make ``module`` and every one of its submodules (imported later) inert."""
    make_inert(module)
    module.__path__ = []  # type: ignore[attr-defined]
    sys.meta_path.insert(0, _InertFinder(module.__name__))
