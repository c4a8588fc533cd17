"""The compile configuration: a frozen, versioned dataclass written into every artifact.

It is composed of the passes' own option dataclasses (`QuantizeOptions`, ...), so a pass reads
typed fields and the CLI only parses flags into this object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from thin.passes import QuantizeOptionError, QuantizeOptions

CONFIG_SCHEMA = 2
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
    # One format for every linear weight (`--quant`); the default keeps everything as stored.
    quantize: QuantizeOptions = field(default_factory=QuantizeOptions)

    def __post_init__(self):
        if self.schema != CONFIG_SCHEMA:
            raise CompileOptionError(f"compile config schema {self.schema} is not {CONFIG_SCHEMA}")
        if self.target not in TARGETS:
            raise CompileOptionError(f"unknown target {self.target!r}; known targets: {', '.join(TARGETS)}")
        if not isinstance(self.fuse_projections, bool):
            raise CompileOptionError("fuse_projections must be true or false")
        if not isinstance(self.quantize, QuantizeOptions):
            raise CompileOptionError("quantize must be a QuantizeOptions")

    @classmethod
    def from_options(cls, **options) -> CompileConfig:
        """Build from keyword options, refusing names that are not options. The quantization
        options may be given flat: quant="int4", group_size=64, asymmetric=True, keep_lm_head=True."""
        flat = {"quant": "format", "group_size": "group_size", "asymmetric": "asymmetric",
                "keep_lm_head": "keep_lm_head"}
        known = {f.name for f in dataclasses.fields(cls)} - {"schema"}
        unknown = sorted(set(options) - known - set(flat))
        if unknown:
            raise CompileOptionError(f"unknown compile option(s) {', '.join(unknown)}; "
                                     f"known options: {', '.join(sorted(known | set(flat)))}")
        quant = {flat[k]: options.pop(k) for k in list(options) if k in flat}
        try:
            if quant:
                if "quantize" in options:
                    raise CompileOptionError("give either quantize=QuantizeOptions(...) or the flat options")
                options["quantize"] = QuantizeOptions(**quant)
            return cls(**options)
        except QuantizeOptionError as e:
            raise CompileOptionError(str(e)) from None

    def to_plain(self) -> dict:
        return dataclasses.asdict(self)
