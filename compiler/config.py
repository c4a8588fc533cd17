"""The compile configuration: a frozen, versioned dataclass written into every artifact.

It is composed of the passes' own option dataclasses (`QuantizeOptions`, `PlanOptions`, ...), so a
pass reads typed fields and the CLI only parses flags into this object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from thin.passes import (
    BudgetError,
    CalibrateOptions,
    CalibrationError,
    CertifyOptions,
    FFNLevelOptionError,
    FFNLevelOptions,
    PlanOptions,
    QuantizeOptionError,
    QuantizeOptions,
    ResidencyOptions,
    ScoreOptions,
    parse_size,
)

CONFIG_SCHEMA = 5  # 4: ffn (elastic FFN levels); 5: residency (--stream-experts)
TARGETS = ("generic",)
DEVICES = ("cpu", "cuda")


class CompileOptionError(ValueError):
    """An unknown compile option or a value outside what it accepts."""


@dataclass(frozen=True)
class CompileConfig:
    """Every option that changes the artifact's bytes. Paths, verbosity and caching are not here:
    they never change the result, so they are not part of the cache key either. (The calibration
    text is an input like the checkpoint: the key hashes its content.)"""

    schema: int = CONFIG_SCHEMA
    # What the tensor layout is prepared for. Only the portable layout exists so far.
    target: str = "generic"
    # Fuse q/k/v and gate/up into single projections (one matmul each at run time).
    fuse_projections: bool = True
    # One format for every linear weight (`--quant`), and the rounding method (`--method`).
    quantize: QuantizeOptions = field(default_factory=QuantizeOptions)
    # The budget (`--bpw`, `--vram`, `--ctx`): with one, the planner picks every tensor's format.
    plan: PlanOptions = field(default_factory=PlanOptions)
    calibrate: CalibrateOptions = field(default_factory=CalibrateOptions)
    score: ScoreOptions = field(default_factory=ScoreOptions)
    certify: CertifyOptions = field(default_factory=CertifyOptions)
    # Elastic FFN levels (`--ffn-levels`): importance-ordered FFN channels and certified cheaper prefixes.
    ffn: FFNLevelOptions = field(default_factory=FFNLevelOptions)
    # Experts beyond VRAM (`--stream-experts` with `--vram`): the device budget the residency plan meets.
    residency: ResidencyOptions = field(default_factory=ResidencyOptions)
    # Where calibration and certification run ("cpu" or "cuda"); None for a compile that never
    # runs the model. Float results differ between devices, so this is part of the key.
    device: str | None = None

    def __post_init__(self):
        if self.schema != CONFIG_SCHEMA:
            raise CompileOptionError(f"compile config schema {self.schema} is not {CONFIG_SCHEMA}")
        if self.target not in TARGETS:
            raise CompileOptionError(f"unknown target {self.target!r}; known targets: {', '.join(TARGETS)}")
        if not isinstance(self.fuse_projections, bool):
            raise CompileOptionError("fuse_projections must be true or false")
        for name, kind in (("quantize", QuantizeOptions), ("plan", PlanOptions), ("calibrate", CalibrateOptions),
                           ("score", ScoreOptions), ("certify", CertifyOptions), ("ffn", FFNLevelOptions),
                           ("residency", ResidencyOptions)):
            if not isinstance(getattr(self, name), kind):
                raise CompileOptionError(f"{name} must be a {kind.__name__}")
        if self.plan.planned and self.quantize.format is not None:
            raise CompileOptionError("give either --quant FORMAT (one format everywhere) or a budget "
                                     "(--bpw / --vram: the planner picks the formats), not both")
        if self.quantize.method is None:  # resolve, so the artifact records what ran
            method = "gptq" if self.plan.planned else "rtn"
            object.__setattr__(self, "quantize", dataclasses.replace(self.quantize, method=method))
        if self.quantize.method == "gptq" and not self.quantized:
            raise CompileOptionError("--method needs --quant FORMAT or a budget (--bpw / --vram)")
        if self.device is not None and self.device not in DEVICES:
            raise CompileOptionError(f"--device takes {' or '.join(DEVICES)}, got {self.device!r}")
        if self.evaluated and self.device is None:
            raise CompileOptionError("a compile that runs the model needs a device (cpu or cuda)")
        if not self.evaluated and self.device is not None:
            raise CompileOptionError("--device is for compiles that run the model: a budget (--bpw / --vram), "
                                     "--method gptq or --max-kld")
        if self.certify.allow_uncertified and not self.certified:
            raise CompileOptionError("--allow-uncertified needs a certificate: a budget or --max-kld")

    @property
    def quantized(self) -> bool:
        return self.plan.planned or self.quantize.format is not None

    @property
    def calibrated(self) -> bool:
        """Calibration runs: the planner scores with it, GPTQ rounds with it, FFN levels order by it, the
        residency plan ranks experts by its routing counts."""
        return self.plan.planned or (self.quantized and self.quantize.method == "gptq") or self.ffn.enabled \
            or self.residency.enabled

    @property
    def certified(self) -> bool:
        """A certificate is measured: always for a planned compile and for FFN levels (each level is
        measured); for --quant when --max-kld asks."""
        return self.plan.planned or (self.quantized and self.certify.max_kld is not None) or self.ffn.enabled

    @property
    def evaluated(self) -> bool:
        """The compile runs the model (calibration, certificate)."""
        return self.calibrated or self.certified

    @classmethod
    def from_options(cls, **options) -> CompileConfig:
        """Build from keyword options, refusing names that are not options. The pass options may be
        given flat: quant="int4", group_size=64, asymmetric=True, keep_lm_head=True, method="gptq",
        bpw=4.5, vram="8G", ctx=4096, tie_fused=True, max_expert_formats=2, calib_tokens=8192, calib_source="file",
        max_kld=0.01, allow_uncertified=True, formats=("int4", "q2"), expert_formats="q2", ffn_levels=(0.75, 0.5),
        ffn_importance="output", ffn_per_layer=True, ffn_correction="scale", stream_experts=True (with vram:
        the budget then bounds the device and the residency plan meets it). `device` defaults to cuda
        when a GPU is present for a compile that runs the model."""
        flat = {"quant": ("quantize", "format"), "group_size": ("quantize", "group_size"),
                "asymmetric": ("quantize", "asymmetric"), "keep_lm_head": ("quantize", "keep_lm_head"),
                "method": ("quantize", "method"), "act_order": ("quantize", "act_order"),
                "bpw": ("plan", "bpw"), "vram": ("plan", "vram"), "ctx": ("plan", "ctx"),
                "tie_fused": ("plan", "tie_fused"), "max_expert_formats": ("plan", "max_expert_formats"),
                "calib_tokens": ("calibrate", "tokens"),
                "calib_source": ("calibrate", "source"), "formats": ("score", "formats"),
                "probe_windows": ("score", "probe_windows"),
                "expert_formats": ("score", "expert_formats"), "max_kld": ("certify", "max_kld"),
                "allow_uncertified": ("certify", "allow_uncertified"), "ffn_levels": ("ffn", "levels"),
                "ffn_importance": ("ffn", "importance"), "ffn_per_layer": ("ffn", "per_layer"),
                "ffn_correction": ("ffn", "correction"), "stream_experts": ("residency", "stream")}
        known = {f.name for f in dataclasses.fields(cls)} - {"schema"}
        unknown = sorted(set(options) - known - set(flat))
        if unknown:
            raise CompileOptionError(f"unknown compile option(s) {', '.join(unknown)}; "
                                     f"known options: {', '.join(sorted(known | set(flat)))}")
        groups: dict[str, dict] = {}
        for key in list(options):
            if key in flat and options[key] is not None and (options[key] is not False or key == "ffn_per_layer"):
                group, name = flat[key]
                groups.setdefault(group, {})[name] = options.pop(key)
            elif key in flat:
                options.pop(key)
        try:
            plan = groups.get("plan", {})
            if isinstance(plan.get("vram"), str):
                plan["vram"] = parse_size(plan["vram"])
            for key in ("formats", "expert_formats"):  # "q2,trellis" or a sequence of names
                if key in groups.get("score", {}):
                    value = groups["score"][key]
                    groups["score"][key] = tuple(
                        f.strip() for f in (value.split(",") if isinstance(value, str) else value) if f.strip())
            if groups.get("residency", {}).pop("stream", False):
                if "vram" not in plan:
                    raise CompileOptionError("--stream-experts needs --vram SIZE: the device budget the experts "
                                             "that do not fit stream around")
                groups["residency"]["vram"] = plan.pop("vram")
                if not plan:
                    groups.pop("plan")
            if "levels" in groups.get("ffn", {}):
                groups["ffn"]["levels"] = ffn_levels(groups["ffn"]["levels"])
            kinds = {"quantize": QuantizeOptions, "plan": PlanOptions, "calibrate": CalibrateOptions,
                     "score": ScoreOptions, "certify": CertifyOptions, "ffn": FFNLevelOptions,
                     "residency": ResidencyOptions}
            for group, values in groups.items():
                if group in options:
                    raise CompileOptionError(f"give either {group}=... or its flat options, not both")
                options[group] = kinds[group](**values)
            _check_flags(options, groups)
            if options.get("device") is None and _evaluates(options):
                from .evaluate import default_device

                options["device"] = default_device()
            return cls(**options)
        except (QuantizeOptionError, BudgetError, CalibrationError, FFNLevelOptionError, ValueError) as e:
            if isinstance(e, CompileOptionError):
                raise
            raise CompileOptionError(str(e)) from None

    def to_plain(self) -> dict:
        return dataclasses.asdict(self)


def ffn_levels(value) -> tuple[float, ...]:
    """--ffn-levels as keep fractions: "1,0.875,3/4" or a sequence of numbers; 1 (always certified) is left
    out. CompileOptionError for anything else."""
    from fractions import Fraction

    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        keeps = [float(Fraction(v.strip())) if isinstance(v, str) else v for v in items if v != ""]
    except (ValueError, ZeroDivisionError):
        raise CompileOptionError(f"--ffn-levels takes keep fractions such as 1,0.875,0.75,0.5 or 5/6, "
                                 f"got {value!r}") from None
    levels = tuple(k for k in keeps if k != 1)
    if not levels:
        raise CompileOptionError("--ffn-levels needs at least one keep fraction below 1")
    return levels


def _evaluates(options: dict) -> bool:
    """Whether a config from these options will run the model (so it needs a device)."""
    quantize, plan, certify = options.get("quantize"), options.get("plan"), options.get("certify")
    planned = plan is not None and plan.planned
    quant = quantize is not None and quantize.format is not None
    levels = options.get("ffn") is not None and options["ffn"].enabled
    streams = options.get("residency") is not None and options["residency"].enabled
    return planned or levels or streams or (quant and (quantize.method == "gptq" or (certify is not None
                                                                            and certify.max_kld is not None)))


def _check_flags(options: dict, groups: dict) -> None:
    """Flags that would do nothing without what they modify are errors, not silent no-ops."""
    planned = "plan" in groups and ("bpw" in groups["plan"] or "vram" in groups["plan"])
    quantizes = planned or "format" in groups.get("quantize", {})
    gptq = planned or groups.get("quantize", {}).get("method") == "gptq"
    streams = "residency" in groups
    if not planned and ("tie_fused" in groups.get("plan", {}) or "max_expert_formats" in groups.get("plan", {})) \
            or not (planned or streams) and "ctx" in groups.get("plan", {}):
        raise CompileOptionError("--ctx, --tie-fused and --max-expert-formats need a budget (--bpw or --vram)")
    levels = "levels" in groups.get("ffn", {})
    if not gptq and not levels and not streams and "calibrate" in groups:
        raise CompileOptionError("--calib and --calib-tokens need calibration: a budget (--bpw / --vram), "
                                 "--method gptq or --ffn-levels")
    if groups.get("quantize", {}).get("method") == "rtn" and "calibrate" in groups and not planned and not levels \
            and not streams:
        raise CompileOptionError("--method rtn with --quant does not calibrate; drop --calib / --calib-tokens")
    if not quantizes and "certify" in groups:
        raise CompileOptionError("--max-kld and --allow-uncertified need a quantized compile (a budget or --quant)")
    if not planned and groups.get("certify", {}).get("allow_uncertified") and \
            groups["certify"].get("max_kld") is None:
        raise CompileOptionError("--allow-uncertified needs a certificate: a budget or --max-kld")
    if not planned and "score" in groups:
        given = ", ".join(f"--{k.replace('_', '-')}" if k in ("expert_formats", "formats") else k
                          for k in sorted(groups["score"]))
        raise CompileOptionError(f"{given}: planner options; give a budget (--bpw / --vram)")
    if "ffn" in groups and "levels" not in groups["ffn"]:
        raise CompileOptionError("ffn_importance, ffn_per_layer and ffn_correction shape FFN levels: give --ffn-levels")
