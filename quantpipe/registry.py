"""Plug-ins by name: the classes a params key may name (quantize_static.engine, bench.runtimes),
the built-in ones and any registered from your own code before a stage runs."""

from __future__ import annotations

from collections.abc import Iterable

from quantpipe.errors import UserError


class Registry:
    """Classes by their `name` attribute; `key` is the params key that names them."""

    def __init__(self, key: str, built_in: Iterable[type]) -> None:
        self.key = key
        self.classes: dict[str, type] = {cls.name: cls for cls in built_in}

    def register(self, cls: type) -> type:
        """Make `cls` nameable in the params key (usable as a class decorator)."""
        self.classes[cls.name] = cls
        return cls

    def names(self) -> list[str]:
        return list(self.classes)

    def get(self, name: str) -> type:
        """The class called `name`; one line naming the key and the names allowed otherwise."""
        if name not in self.classes:
            raise UserError(f"{self.key}: {name!r} is not allowed; use one of {self.names()}")
        return self.classes[name]
