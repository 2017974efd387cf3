"""Which Core ML programs a Mac can load: the export's target OS and specification, picked by the macOS version.

Core ML compiles a package only when its specification version is one the running OS knows (coremltools 9:
spec 8 = iOS 17 / macOS 14, 9 = iOS 18 / macOS 15, 10 = iOS 26 / macOS 26). What hetero's programs need:

- fp16 weights, single-function packages: spec 8, macOS 14 (`MACOS14`);
- per-group lookup tables (`constexpr_lut_to_dense` with tables per block), `constexpr_blockwise_shift_scale` and
  multifunction packages (context buckets sharing their weights): spec 9, macOS 15 (`MACOS15`).

So a Mac below macOS 15 gets fp16 programs, one package per context bucket, whatever `--ane-weights` asks (a
quantized checkpoint's share is dequantized: MLX's weights rounded once to fp16, the tables' very values); from
macOS 15 any weight form runs. The target is part of every package's key and of the export directory's name, and the
runtime loads an export only when its target is this Mac's (`check_target`): a cache shared across OS versions never
hands macOS 14 a program it cannot compile, nor macOS 15 a fallback it does not need.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.errors import HeteroError

WEIGHT_FORMS = ("fp16", "lut", "blockwise")  # `--ane-weights`: how quantized weights reach the ANE (all exact)
DEFAULT_WEIGHT_FORM = "lut"
COMPRESSED_FORMS = ("lut", "blockwise")  # forms with iOS 18 / macOS 15 ops


@dataclass(frozen=True)
class Target:
    """An export target: the oldest macOS its packages load on, their Core ML specification version, the weight
    forms it can embed and whether context buckets may share one multifunction package."""

    macos: tuple[int, int]
    spec: int
    forms: tuple[str, ...]
    multifunction: bool

    @property
    def name(self) -> str:
        """`macos14-spec8`: what the export directory and every package key carry."""
        return f"macos{self.macos[0]}-spec{self.spec}"

    def to_dict(self) -> dict:
        return {"name": self.name, "macos": ".".join(map(str, self.macos)), "spec": self.spec,
                "forms": list(self.forms), "multifunction": self.multifunction}


MACOS14 = Target((14, 0), 8, ("fp16",), multifunction=False)
MACOS15 = Target((15, 0), 9, WEIGHT_FORMS, multifunction=True)
TARGETS = (MACOS14, MACOS15)

# The newest Core ML specification each macOS compiles (coremltools' _SPECIFICATION_VERSION_IOS_*): a newer spec is
# refused by the OS's compiler before anything runs.
SPECS = ((26, 10), (15, 9), (14, 8), (13, 7), (12, 6))


def max_spec(macos: tuple[int, ...]) -> int:
    """The newest specification version macOS `macos` compiles."""
    return next((spec for major, spec in SPECS if macos[0] >= major), 5)


def target_for(macos: tuple[int, ...] | None) -> Target:
    """The target for a Mac running `macos` (None: not a Mac, where the reference executor runs any program: the
    newest target, as a macOS 15 Mac would get). Below macOS 14 no target loads (HeteroError)."""
    if macos is None:
        return TARGETS[-1]
    fits = [t for t in TARGETS if tuple(macos) >= t.macos]
    if not fits:
        raise HeteroError(f"macOS {'.'.join(map(str, macos))}: the ANE lane needs macOS 14 or later (its programs are "
                          f"Core ML spec 8); prefill stays on the GPU")
    return fits[-1]


def check_weight_form(form: str) -> str:
    """`form` when it is one of `WEIGHT_FORMS`; else one HeteroError line."""
    if form not in WEIGHT_FORMS:
        raise HeteroError(f"--ane-weights {form!r}: must be one of {', '.join(WEIGHT_FORMS)}")
    return form


def weight_form_for(form: str, target: Target) -> tuple[str, str | None]:
    """(the form an export for `target` embeds when `form` is asked, why it differs or None): below macOS 15 the
    tables and shift-scale ops do not exist, so every form is fp16 there (exact too: MLX's weights rounded once)."""
    check_weight_form(form)
    if form in target.forms:
        return form, None
    return "fp16", (f"--ane-weights {form} needs macOS 15 (Core ML spec 9); this Mac's programs are built for "
                    f"{target.name}: fp16 weights, MLX's own rounded once, the same values")


def check_target(found: str | None, target: Target, where: str) -> None:
    """HeteroError unless an export built for target `found` (its manifest's) is one for `target`: a package built
    for another OS is never loaded (macOS 14 would refuse a spec 9 program; macOS 15 needs no fp16 fallback)."""
    if found != target.name:
        raise HeteroError(f"{where} was exported for {found or 'an unnamed target'}, not this Mac's {target.name}: "
                          f"not loaded (re-export: hetero convert --coreml, or let the split export on first use)")


OS_REFUSED = "the OS refuses it"  # in every refusal's words (`check_spec`, `coreml_macos._compiled`): the doctor's
# `os` check finds it in whatever error carries it


def check_spec(spec: int, macos: tuple[int, ...] | None, what: str) -> None:
    """HeteroError (`SpecRefused`) when macOS `macos` cannot compile a package of specification `spec`: named as the
    OS refusing it, before Core ML's compiler says it in its own words."""
    if macos is not None and spec > max_spec(macos):
        fits = [t.name for t in TARGETS if tuple(macos) >= t.macos]
        fix = f"re-export for this Mac ({fits[-1]})" if fits else "the ANE lane needs macOS 14 or later"
        raise SpecRefused(f"{what}: Core ML spec {spec} needs a newer macOS than {'.'.join(map(str, macos))} "
                          f"(which compiles spec {max_spec(macos)} at most): {OS_REFUSED}; {fix}")


class SpecRefused(HeteroError):
    """The running macOS cannot compile a package's specification version."""
