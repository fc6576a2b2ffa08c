"""``LoraConfig``: what an adapter is, checked once, shared by ``apply_lora``, the CLI and the adapter files.

>>> config = LoraConfig(r=8, lora_alpha=16)
>>> config.scaling, config.target_modules
(2.0, ('q_proj', 'v_proj'))
>>> LoraConfig(lora_alpha=float("nan"))
Traceback (most recent call last):
...
ValueError: lora_alpha must be a finite number > 0, got nan

Modelled on PEFT's ``LoraConfig`` (``peft/tuners/lora/config.py``), restricted to what this
package implements: plain LoRA, output = base(x) + scaling · B·A·dropout(x) with scaling =
lora_alpha / r (lora_alpha / sqrt(r) with ``use_rslora``), on the linear modules the target
fields select, as PEFT selects them (``selects``). ``init``, ``seed`` and ``backend`` say how
adapters start and run here; adapter files do not store them.

``LoraConfig.from_peft`` reads a real ``peft.LoraConfig`` (or an ``adapter_config.json``'s
fields): every option PEFT has that changes the model in a way this package does not
implement (DoRA, trained biases, ``modules_to_save``, ...) is refused by name, and so is any
option this package does not know whose value is not off.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .init import INITS

__all__ = ["ALL_LINEAR", "BACKENDS", "LoraConfig"]

BACKENDS = ("wgpu", "torch")  # where LoRALinear computes its adapter: WebGPU kernels, or torch ops

_FLOAT32_MAX = float(np.finfo(np.float32).max)  # the kernels compute in float32
_SEED_LIMIT = 2 ** 64  # torch.Generator.manual_seed (PEFT's init) and Hesper's u64 seeds
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear module but the output layer
_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")  # a module name or a dotted suffix of one

# PEFT options that make the model something other than base + scaling·B·A on the targeted
# linear layers; each is refused unless its value is off (None, False, "none", empty).
PEFT_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "bias": "trained biases (bias)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "fan_in_fan_out": "transposed (Conv1D) base weights (fan_in_fan_out)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "target_parameters": "adapters on raw parameters (target_parameters)",
    "layer_replication": "replicated layers (layer_replication)",
    "megatron_config": "Megatron parallel layers (megatron_config)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA input pooling (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
}
# Options that describe the file or the run, not the model (any value is fine), and the
# initialisers' own settings (init_lora_weights says whether they were used).
_PEFT_DESCRIPTIVE = {
    "peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "megatron_core", "qalora_group_size", "ensure_weight_tying", "runtime_config",
    "loftq_config", "eva_config", "corda_config", "lora_ga_config",
}
# The fields LoraConfig reads from a PEFT config.
_PEFT_FIELDS = {"r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "layers_to_transform",
                "layers_pattern", "rank_pattern", "alpha_pattern", "use_rslora", "init_lora_weights"}
# PEFT initialisations that also change the base weights (the adapter starts from the base's own
# components, which are taken out of it): the adapter belongs to those changed weights.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# PEFT's other initialisations, as ours; the rest only set up training (eva, orthogonal, ...) and
# cannot be reproduced here.
_PEFT_INITS = {True: "peft", "gaussian": "gaussian"}


def _is_off(value: Any) -> bool:
    return value is None or value is False or value in ("none", "") or (isinstance(value, (dict, list, set, tuple))
                                                                         and not value)


def base_changing_init(value: Any) -> str | None:
    """The name of a PEFT ``init_lora_weights`` value that changes the base weights (``"pissa"``
    for ``"pissa_niter_4"``), else None.

    >>> base_changing_init("pissa_niter_4"), base_changing_init(True)
    ('pissa', None)
    """
    if isinstance(value, str):
        for name in _BASE_CHANGING_INITS:
            if value.lower() == name or value.lower().startswith(f"{name}_"):
                return name
    return None


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapter settings, validated on construction (a ValueError names the bad field).

    * ``r``: rank, a positive integer;
    * ``lora_alpha``: a finite number > 0 (ints, floats, numpy scalars); scaling = lora_alpha / r
      (lora_alpha / sqrt(r) with ``use_rslora``), which must fit in float32;
    * ``target_modules``, as PEFT takes it: module names, each the last part or parts of a
      qualified name (``"q_proj"``, ``"self_attn.q_proj"``); ``"all-linear"`` (every linear
      module but the output layer); or a regular expression that a whole qualified name must
      match (``".*[.](q|v)_proj"``). A string made of letters, digits and ``_`` alone is one name;
    * ``exclude_modules``: modules never to adapt, in the same forms (names or a regex);
    * ``layers_to_transform``: with names, only modules in these decoder layers (indices), found
      after ``layers_pattern`` (names such as ``"layers"``; default: the first ``.<name>.<index>.``);
    * ``rank_pattern`` / ``alpha_pattern``: {regex: rank} / {regex: alpha} for modules whose
      qualified name ends with a match (the first matching key wins, as in PEFT);
    * ``use_rslora``: rank-stabilised scaling lora_alpha / sqrt(r);
    * ``lora_dropout``: dropout probability on the adapter's input, in [0, 1);
    * ``init``: ``"hesper"`` (Hesper's seeded Kaiming-uniform, bit for bit), ``"peft"`` (PEFT's
      default) or ``"gaussian"`` (PEFT's ``init_lora_weights="gaussian"``: N(0, 1/r²));
    * ``seed``: base seed of lora_A's initialisation, an integer in [0, 2**64);
    * ``backend``: ``"wgpu"`` (the WebGPU kernels) or ``"torch"`` (plain torch ops).

    >>> dataclasses.replace(LoraConfig(), r=16).r
    16
    """

    r: int = 8
    lora_alpha: float = 8.0
    target_modules: tuple[str, ...] | str = ("q_proj", "v_proj")
    lora_dropout: float = 0.0
    init: str = "hesper"
    seed: int = 42
    backend: str = "wgpu"
    exclude_modules: tuple[str, ...] | str | None = None
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    use_rslora: bool = False

    def __post_init__(self) -> None:
        def set_field(name: str, value: Any) -> None:  # frozen: normalised values go in this way
            object.__setattr__(self, name, value)

        set_field("r", _positive_integer("r", self.r))
        set_field("lora_alpha", _positive_real("lora_alpha", self.lora_alpha))
        set_field("target_modules", _targets("target_modules", self.target_modules, all_linear=True))
        if self.exclude_modules is not None:
            set_field("exclude_modules", _targets("exclude_modules", self.exclude_modules, all_linear=False))
        set_field("layers_to_transform", _layers(self.layers_to_transform))
        set_field("layers_pattern", _layers_pattern(self.layers_pattern))
        if self.layers_to_transform is not None and isinstance(self.target_modules, str):
            raise ValueError("layers_to_transform takes module names as target_modules (as in PEFT), not "
                             f"{self.target_modules!r}")
        set_field("rank_pattern", _pattern("rank_pattern", self.rank_pattern, _positive_integer))
        set_field("alpha_pattern", _pattern("alpha_pattern", self.alpha_pattern, _positive_real))
        if not isinstance(self.use_rslora, (bool, np.bool_)):
            raise ValueError(f"use_rslora must be True or False, got {self.use_rslora!r}")
        set_field("use_rslora", bool(self.use_rslora))
        for r in {self.r, *self.rank_pattern.values()}:
            for alpha in {self.lora_alpha, *self.alpha_pattern.values()}:
                if _scaling(alpha, r, self.use_rslora) > _FLOAT32_MAX:
                    raise ValueError(f"lora_alpha={alpha!r} gives scaling lora_alpha / "
                                     f"{'sqrt(r)' if self.use_rslora else 'r'} = "
                                     f"{_scaling(alpha, r, self.use_rslora):.3g}{'' if r == self.r else f' (r={r})'}, "
                                     f"beyond float32's largest value ({_FLOAT32_MAX:.3g}) that the kernels compute in")
        dropout = self.lora_dropout
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"lora_dropout must be a number in [0, 1), got {dropout!r}")
        set_field("lora_dropout", float(dropout))
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        set_field("seed", _seed(self.seed))
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    @property
    def scaling(self) -> float:
        """lora_alpha / r (lora_alpha / sqrt(r) with ``use_rslora``), the factor on every adapter's
        output where no pattern says otherwise."""
        return _scaling(self.lora_alpha, self.r, self.use_rslora)

    def selects(self, name: str) -> bool:
        """Whether the module of qualified name ``name`` gets an adapter (if it is linear; with
        ``"all-linear"``, every name is selected and the caller keeps the linear ones), by PEFT's rules.

        >>> config = LoraConfig(target_modules=("q_proj",), layers_to_transform=[1])
        >>> config.selects("model.layers.1.self_attn.q_proj"), config.selects("model.layers.0.self_attn.q_proj")
        (True, False)
        """
        if self.exclude_modules is not None and _matches(self.exclude_modules, name):
            return False
        if isinstance(self.target_modules, str):
            return self.target_modules == ALL_LINEAR or re.fullmatch(self.target_modules, name) is not None
        if not _matches(self.target_modules, name):
            return False
        if self.layers_to_transform is None:
            return True
        index = self.layer_index(name)
        return index is not None and index in self.layers_to_transform

    def layer_index(self, name: str) -> int | None:
        """The layer index in ``name`` that ``layers_to_transform`` reads (PEFT's rule: the number
        after the first of ``layers_pattern``, else after the first ``.<name>.<index>.``)."""
        patterns = self.layers_pattern or (None,)
        for pattern in patterns:
            regex = r".*?\.[^.]*\.(?P<idx>\d+)\." if pattern is None else rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."
            match = re.match(regex, name)
            if match:
                return int(match["idx"])
        return None

    def rank_of(self, name: str) -> int:
        """The rank of the adapter on module ``name``: ``rank_pattern``'s, else ``r``."""
        return _by_pattern(self.rank_pattern, name, self.r)

    def alpha_of(self, name: str) -> float:
        """The lora_alpha of the adapter on module ``name``: ``alpha_pattern``'s, else ``lora_alpha``."""
        return _by_pattern(self.alpha_pattern, name, self.lora_alpha)

    def scaling_of(self, name: str) -> float:
        """The scaling of the adapter on module ``name``."""
        return _scaling(self.alpha_of(name), self.rank_of(name), self.use_rslora)

    def updated(self, **fields: Any) -> LoraConfig:
        """A copy with ``fields`` replaced (and checked); an unknown field name raises TypeError.

        >>> LoraConfig().updated(r=4, lora_alpha=8).scaling
        2.0
        """
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise TypeError(f"unknown LoraConfig field(s) {unknown}; the fields are {sorted(known)}")
        return dataclasses.replace(self, **fields)

    @classmethod
    def from_peft(cls, config: Any) -> LoraConfig:
        """Our config for a real ``peft.LoraConfig`` (``from_peft_fields`` of its fields).

        >>> # apply_lora(model, LoraConfig.from_peft(peft.LoraConfig(r=8, target_modules="all-linear")))
        """
        if type(config).__module__.split(".")[0] != "peft" or not callable(getattr(config, "to_dict", None)):
            raise TypeError(f"config must be a LoraConfig (torch_wgpu_lora's or peft's), got {type(config).__name__}; "
                            "pass settings as keywords (apply_lora(model, r=8)) or apply_lora(model, LoraConfig(r=8))")
        return cls.from_peft_fields(config.to_dict(), f"the peft {type(config).__name__}")

    @classmethod
    def from_peft_fields(cls, fields: Mapping[str, Any], source: str, *, loading: bool = False,
                         residual_base: bool = False) -> LoraConfig:
        """Our config for a PEFT config's fields (a ``peft.LoraConfig``'s ``to_dict()``, an
        ``adapter_config.json``), ``source`` naming where they came from in errors.

        Every PEFT option that changes the model in a way this package does not implement is
        refused by name, as is any unknown option that is not off. ``init_lora_weights`` True
        and ``"gaussian"`` become ``init`` "peft" and "gaussian". ``loading=True`` (an adapter
        file, whose weights replace any initial values): only initialisations that changed the
        base weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA) matter, and they are refused unless
        ``residual_base`` says the model is the base they changed.

        >>> LoraConfig.from_peft_fields({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
        ...                             "adapter_config.json").scaling
        2.0
        """
        fields = dict(fields)
        peft_type = fields.get("peft_type")
        peft_type = getattr(peft_type, "value", peft_type)  # peft's PeftType enum, or its JSON string
        if peft_type != "LORA":
            raise ValueError(f"{source}: peft_type is {peft_type!r}; only LoRA adapters (peft_type 'LORA') "
                             "are supported")
        for key, value in fields.items():
            if key in PEFT_UNSUPPORTED and not _is_off(value):
                raise ValueError(f"{source}: {key}={value!r} asks for {PEFT_UNSUPPORTED[key]}, which "
                                 "torch_wgpu_lora does not implement; it would give a different model")
            if key not in PEFT_UNSUPPORTED and key not in _PEFT_DESCRIPTIVE and key not in _PEFT_FIELDS \
                    and not _is_off(value):
                raise ValueError(f"{source}: unknown option {key}={value!r} (from a newer peft?); it may change the "
                                 "model in a way torch_wgpu_lora cannot reproduce, so it is refused")
        init_weights = fields.get("init_lora_weights", True)
        changed = base_changing_init(init_weights)
        init = "peft"  # a file's weights replace the initial values: the fastest init
        if changed is not None and (not loading or not residual_base):
            why = (f"{source}: init_lora_weights={init_weights!r} ({changed}) starts the adapter from the base weights' "
                   "own components and takes them out of the base, so the adapter belongs to those changed weights")
            if not loading:
                raise ValueError(f"{why}; torch_wgpu_lora does not change base weights: use init_lora_weights=True "
                                 "or 'gaussian'")
            raise ValueError(f"{why}: on the original base it gives another model. Load it into the base that "
                             "peft changed, saying so (residual_base=True), or have peft convert it into a plain "
                             "LoRA adapter for the original base (save_pretrained(..., "
                             "path_initial_model_for_weight_conversion=<the adapter as initialised>))")
        if not loading and changed is None:
            init = _PEFT_INITS.get(init_weights.lower() if isinstance(init_weights, str) else init_weights is True)
            if init is None:
                raise ValueError(f"{source}: init_lora_weights={init_weights!r} is not implemented by torch_wgpu_lora; "
                                 "use True (PEFT's default) or 'gaussian'")
        targets = fields.get("target_modules")
        if targets is None:
            raise ValueError(f"{source}: target_modules is not set; name the modules to adapt (or 'all-linear')")
        if isinstance(targets, (set, frozenset)):
            targets = tuple(sorted(targets))  # peft keeps a set; sorted, so that seeds follow a fixed order
        exclude = fields.get("exclude_modules")
        if isinstance(exclude, (set, frozenset)):
            exclude = tuple(sorted(exclude))
        layers = fields.get("layers_to_transform")
        pattern = fields.get("layers_pattern")
        try:
            return cls(r=fields.get("r", 8), lora_alpha=fields.get("lora_alpha", 8),
                       lora_dropout=fields.get("lora_dropout", 0.0), target_modules=targets,
                       exclude_modules=exclude or None,
                       layers_to_transform=[layers] if isinstance(layers, numbers.Integral) else layers,
                       layers_pattern=[pattern] if isinstance(pattern, str) else pattern,
                       rank_pattern=fields.get("rank_pattern") or {}, alpha_pattern=fields.get("alpha_pattern") or {},
                       use_rslora=fields.get("use_rslora", False), init=init)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None


def _scaling(alpha: float, r: int, rslora: bool) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r


def _matches(targets: tuple[str, ...] | str, name: str) -> bool:
    """PEFT's match of a qualified module name: a regex matching all of it, or a name it is or ends with."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in targets)


def _by_pattern(patterns: Mapping[str, Any], name: str, default: Any) -> Any:
    for key, value in patterns.items():  # PEFT's get_pattern_key: the first key matching the name's end
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _positive_integer(name: str, value: Any) -> int:
    if not _is_integer(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _seed(value: Any) -> int:
    if not _is_integer(value) or not 0 <= value < _SEED_LIMIT:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {value!r}")
    return int(value)


def _positive_real(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) \
            or not math.isfinite(float(value)) or not float(value) > 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _regex(name: str, value: str) -> str:
    try:
        re.compile(value)
    except re.error as err:
        raise ValueError(f"{name}={value!r} is not a valid regular expression: {err}") from None
    return value


def _targets(name: str, value: Any, all_linear: bool) -> tuple[str, ...] | str:
    """Module names as a tuple, or one string: "all-linear" or a regex (a plain name becomes a tuple)."""
    if isinstance(value, str):
        if all_linear and value.lower() == ALL_LINEAR:
            return ALL_LINEAR
        if re.fullmatch(r"[A-Za-z0-9_]+", value):
            return (value,)
        return _regex(name, value)
    try:
        targets = tuple(value)
    except TypeError:
        raise ValueError(f"{name} must be module names such as ('q_proj', 'v_proj'), 'all-linear' or a regular "
                         f"expression, got {value!r}") from None
    if not targets or not all(isinstance(t, str) and _NAME.fullmatch(t) for t in targets):
        raise ValueError(f"{name} must be one or more module names (the last part of a qualified name, such as "
                         f"'q_proj', or its last parts, such as 'self_attn.q_proj'), got {value!r}")
    if len(set(targets)) != len(targets):
        raise ValueError(f"{name} names a module twice: {value!r}")
    return targets


def _layers(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    layers = (value,) if _is_integer(value) else value
    try:
        layers = tuple(layers)
    except TypeError:
        layers = None
    if not layers or not all(_is_integer(i) and i >= 0 for i in layers):
        raise ValueError(f"layers_to_transform must be layer indices (integers >= 0), got {value!r}")
    return tuple(int(i) for i in layers)


def _layers_pattern(value: Any) -> tuple[str, ...] | None:
    if value is None or (not isinstance(value, str) and not value):
        return None
    patterns = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"layers_pattern must be names such as 'layers', got {value!r}")
    return tuple(_regex("layers_pattern", p) for p in patterns)


def _pattern(name: str, value: Any, check: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a dict of {{regex: value}}, got {value!r}")
    out = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"{name} keys must be non-empty regular expressions, got {key!r}")
        out[_regex(f"{name} key", key)] = check(f"{name}[{key!r}]", item)
    return out
