"""The one exception of the config system."""

from __future__ import annotations


class ConfigError(ValueError):
    """Every config problem: missing file, bad YAML, unknown key, wrong type, contradiction.

    ``problems`` holds one line per problem, each starting with the key path it is
    about (``train.group_size: ...``); ``source`` is the file, when there is one.
    """

    def __init__(self, problems: str | list[str], source: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = str(source) if source is not None else None
        super().__init__(self._format())

    def _format(self) -> str:
        head = f"{self.source}: " if self.source else ""
        if len(self.problems) == 1:
            return head + self.problems[0]
        lines = "\n".join(f"  {p}" for p in self.problems)
        return f"{head}{len(self.problems)} problems:\n{lines}"
