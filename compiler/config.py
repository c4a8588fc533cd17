"""The compile configuration: a frozen, versioned dataclass that is written into every artifact."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

CONFIG_SCHEMA = 1
TARGETS = ("generic",)


class CompileOptionError(ValueError):
    """An unknown compile option or a value outside what it accepts."""


@dataclass(frozen=True)
class CompileConfig:
    """Every option that changes the artifact's bytes. Paths, verbosity and caching are not here:
    they never change the result, so they are not part of the cache key either."""

    schema: int = CONFIG_SCHEMA
    # What the tensor layout is prepared for. Only the portable layout exists so far.
    target: str = "generic"
    # Fuse q/k/v and gate/up into single projections (one matmul each at run time).
    fuse_projections: bool = True

    def __post_init__(self):
        if self.schema != CONFIG_SCHEMA:
            raise CompileOptionError(f"compile config schema {self.schema} is not {CONFIG_SCHEMA}")
        if self.target not in TARGETS:
            raise CompileOptionError(f"unknown target {self.target!r}; known targets: {', '.join(TARGETS)}")
        if not isinstance(self.fuse_projections, bool):
            raise CompileOptionError("fuse_projections must be true or false")

    @classmethod
    def from_options(cls, **options) -> CompileConfig:
        """Build from keyword options, refusing names that are not options."""
        known = {f.name for f in dataclasses.fields(cls)} - {"schema"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise CompileOptionError(f"unknown compile option(s) {', '.join(unknown)}; "
                                     f"known options: {', '.join(sorted(known))}")
        return cls(**options)

    def to_plain(self) -> dict:
        return dataclasses.asdict(self)
