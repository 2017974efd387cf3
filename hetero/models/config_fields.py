"""Reading a checkpoint config's fields, as every architecture's `from_config` does: nested under `text_config` or
flat, and a value that fails its conversion reported by the field's name."""

from __future__ import annotations

from hetero.errors import HeteroError


class ConfigFields:
    """Reads a checkpoint config's fields, from its text_config first, then its top level; remembers the last field
    read, so that a value that fails its conversion (int(), float()) is reported by name (`bad_value`)."""

    def __init__(self, config: dict):
        self.text, self.config, self.last = config.get("text_config") or config, config, None

    def __call__(self, key: str, default=None):
        self.last = key
        return self.text.get(key, self.config.get(key, default))

    def bad_value(self, error: Exception) -> HeteroError:
        """One line naming the field read last (the one whose value failed) and what was wrong with it."""
        value = self(self.last) if self.last is not None else None
        what = "is missing" if value is None else f"has a bad value ({value!r}: {error})"
        return HeteroError(f"config.json: the field {self.last!r} {what}; fix config.json (the checkpoint's own, as "
                           "transformers saves it)")
