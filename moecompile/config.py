"""Backend options: one frozen dataclass, parsed once at the backend boundary and passed down explicitly."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

PASS_NAMES = ("detect", "verify", "canonicalize", "lower")  # what disable_passes may name (expose_sharded and
# distribute always run: they do nothing unless moecompile.parallelize sharded the model, and then a sharded
# layer cannot run without them)
INNER_BACKENDS = ("inductor", "aot_eager")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's, for Inductor
LOWERINGS = ("auto", "original", "torch", "grouped", "triton")
CHOOSE = ("memory", "speed")
LOWERING_ENV = "MOECOMPILE_LOWERING"  # the default of ``lowering`` when options do not give it


def _default_lowering() -> str:
    value = os.environ.get(LOWERING_ENV, "auto") or "auto"
    if value not in LOWERINGS:
        raise ValueError(f"{LOWERING_ENV}={value!r} is not a lowering; choose one of {list(LOWERINGS)} or unset it")
    return value


@dataclass(frozen=True, kw_only=True)
class MoEOptions:
    """Options of ``torch.compile(model, backend="moe", options={...})``.

    inner:            what compiles the graph after the MoE passes: "inductor" (default) or "aot_eager".
    mode:             the inner Inductor's mode, as torch.compile's ``mode`` (which the backend also takes:
                      ``torch.compile(model, backend="moe", mode="max-autotune")``): "default", "reduce-overhead"
                      (CUDA graphs; the moe ops run between the graphed parts), "max-autotune",
                      "max-autotune-no-cudagraphs". Not with inner="aot_eager".
    inductor:         more settings of the inner Inductor, as torch.compile(options=...) gives them to Inductor
                      ({"max_autotune_gemm_backends": "TRITON", "shape_padding": True}); each must name a setting
                      of ``torch._inductor.config``. Applied after the mode's. Not with inner="aot_eager".
    lowering:         the form each proved layer runs in. "auto" (default; ``$MOECOMPILE_LOWERING`` changes the
                      default): every form that can run on the layer's device is timed on the traced shapes with
                      the layer's parameters (forward+backward when training) and the fastest kept (``choose``),
                      the choice cached on disk (passes/forms.py). Or one form, forced: "original" (the model's own
                      code as traced: proved, left as written), "torch" (the canonical ops on torch references),
                      "grouped" (the canonical ops, the expert MLP as torch._grouped_mm GEMMs keeping its
                      projections for backward), "triton" (the Triton kernels; without CUDA in Triton's
                      interpreter, slowly: for tests). A layer sharded by moecompile.parallelize is never
                      "original" (the exchange needs the rewrite).
    choose:           with lowering="auto": "memory" keeps the fastest form whose activations saved for backward
                      take no more bytes than the original's; "speed" the fastest whatever it saves.
    disable_passes:   pass names to skip (see moecompile.pipeline.PASSES). Without "verify" nothing is rewritten.
    strict:           raise instead of leaving an MoE block that could not be proved or rewritten as it was, and
                      instead of running a graph as it came in when a pass (or the inner compiler) fails; also for a
                      whole graph with nothing MoE-like in it (not one cut by a graph break): docs/options.md.
    verify_backward:  also prove gradients (tokens and every parameter) before rewriting.
    verify_lowering:  before a layer's Triton kernels are used, run them beside the proved torch references on
                      probe inputs (forward, and gradients with verify_backward); a layer where they disagree keeps
                      the references, and explain() says so.
    probe_seed:       seed of the random probe tokens used by verify.
    probe_tokens:     at least this many random tokens are routed through each block by verify (in rounds of
                      the block's own token count).
    max_candidates:   most candidate specs verify may try per block.
    record_graphs:    keep the readable graph before and after each pass (explain() turns it on).
    checkpoint_exchanges: for a sharded layer inside an activation-checkpointed region: "recompute" (default) runs
                      its exchanges again when backward recomputes the region; "save" keeps their outputs for
                      backward instead (less traffic, about 2 K x the layer's input more memory): passes/recompute.py.
    capture:          Dynamo captures data-dependent shapes (nonzero(), where(mask), .tolist()) while it traces for
                      this backend, so expert loops stay in the graph and are rewritten; the two Dynamo settings
                      are on only during the moe backend's own compiles (moecompile/tracing/capture.py). False: Dynamo's
                      defaults (such loops break the graph and the block is reported, not rewritten).
    """

    inner: str = "inductor"
    mode: str = "default"
    inductor: tuple[tuple[str, object], ...] = ()  # (setting, value) pairs, sorted: the options' dict, frozen
    lowering: str = field(default_factory=_default_lowering)
    choose: str = "memory"
    disable_passes: tuple[str, ...] = ()
    strict: bool = False
    verify_backward: bool = True
    verify_lowering: bool = True
    probe_seed: int = 0
    probe_tokens: int = 512
    max_candidates: int = 64
    record_graphs: bool = False
    capture: bool = True
    checkpoint_exchanges: str = "recompute"


_CHOICES = {"inner": INNER_BACKENDS, "mode": MODES, "lowering": LOWERINGS, "choose": CHOOSE,
            "checkpoint_exchanges": ("recompute", "save")}


def parse_options(options: dict | MoEOptions | None) -> MoEOptions:
    """Check user options; an unknown key or a bad value raises ValueError naming the valid choices."""
    if options is None:
        return MoEOptions()
    if isinstance(options, MoEOptions):
        return options
    if not isinstance(options, dict):
        raise ValueError(f"options must be a dict, got {type(options).__name__}")
    fields = {f.name: f for f in dataclasses.fields(MoEOptions)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"unknown moecompile option(s) {unknown}; valid options: {sorted(fields)}")
    for key, value in options.items():
        default = fields[key].default if key != "lowering" else "auto"
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ValueError(f"option {key}={value!r} is not valid; choose one of {list(_CHOICES[key])}")
        if key == "inductor":
            _check_inductor_settings(value)
        elif key == "disable_passes":
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError("option disable_passes must be a list of pass names")
            bad = sorted(set(value) - set(PASS_NAMES))
            if bad:
                raise ValueError(f"disable_passes names unknown pass(es) {bad}; passes: {list(PASS_NAMES)}")
        elif isinstance(default, bool) and not isinstance(value, bool):
            raise ValueError(f"option {key} must be True or False, got {value!r}")
        elif isinstance(default, int) and not isinstance(default, bool) and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise ValueError(f"option {key} must be a non-negative int, got {value!r}")
    for key, unset in (("mode", "default"), ("inductor", ())):
        if options.get(key, unset) not in (unset, {}) and options.get("inner", "inductor") != "inductor":
            raise ValueError(f"option {key}={options[key]!r} is for the inner Inductor, and inner="
                             f"{options['inner']!r} has none: leave {key} out, or use inner='inductor'")
    if "disable_passes" in options:
        options = {**options, "disable_passes": tuple(options["disable_passes"])}
    if isinstance(options.get("inductor"), dict):
        options = {**options, "inductor": tuple(sorted((str(k).replace("-", "_"), v)
                                                        for k, v in options["inductor"].items()))}
    return MoEOptions(**options)


def _check_inductor_settings(value) -> None:
    """The option ``inductor``: a dict of settings ``torch._inductor.config`` has, each of its type (as
    torch.compile checks the options it gives Inductor)."""
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)  # MoEOptions' own frozen form
    if not isinstance(value, dict):
        raise ValueError(f"option inductor must be a dict of Inductor settings, got {type(value).__name__}")
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    for name, setting in value.items():
        attr = str(name).replace("-", "_")
        if attr not in known:
            near = sorted(k for k in known if attr.split(".")[-1] in k)[:5]
            raise ValueError(f"option inductor names {name!r}, which is no setting of torch._inductor.config"
                             + (f" (similar: {near})" if near else ""))
        kind = inductor_config.get_type(attr)
        if isinstance(kind, type) and not isinstance(setting, kind) and not (kind is float and
                                                                            isinstance(setting, int)):
            raise ValueError(f"option inductor: {name} takes {kind.__name__}, got {type(setting).__name__}")


def with_mode(options: dict | MoEOptions | None, mode: str | None) -> dict | MoEOptions | None:
    """``options`` with torch.compile's ``mode`` argument in them (torch.compile passes it to the backend beside
    the options, and refuses both at once); a different ``mode`` in the options raises ValueError."""
    if mode is None or not (options is None or isinstance(options, (dict, MoEOptions))):
        return options  # no mode given; or options parse_options refuses with its own error
    if isinstance(options, MoEOptions):  # checked again by parse_options, as a dict
        given = {f.name: getattr(options, f.name) for f in dataclasses.fields(MoEOptions)}
        options = {**given, "mode": given["mode"] if given["mode"] != "default" else mode}
    options = dict(options or {})
    if options.setdefault("mode", mode) != mode:
        raise ValueError(f"mode={mode!r} given to torch.compile, and mode={options['mode']!r} in the moe options: "
                         "give it once")
    return options
