"""Adapter files: PEFT's folder layout and Hesper's binary format, written and read.

>>> # save_adapter(model, "out/adapter")                      # PEFT folder
>>> # PeftModel.from_pretrained(base, "out/adapter")          # real peft loads it
>>> # load_adapter(BitNetForCausalLM.from_pretrained(p), "out/adapter")   # ours, or one trained by peft
>>> # save_adapter(model, "out/adapter.lora", format="hesper")           # Hesper's binary file

**PEFT** (``format="peft"``): a folder holding ``adapter_model.safetensors``, with keys
``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r]
(for example ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), and
``adapter_config.json`` (peft_type "LORA", task_type "CAUSAL_LM", r, lora_alpha,
lora_dropout, target_modules, ...), as ``PeftModel.save_pretrained`` writes them.
Loading also takes adapters that peft trained, as long as they describe plain LoRA:
options that change the model in other ways (DoRA, rsLoRA, biases, rank or alpha
patterns, modules_to_save, ...) are refused by name, and so is any option this module
does not know whose value is not off. ``adapter_model.bin`` is a pickle and is refused:
loading never unpickles.

**Hesper** (``format="hesper"``): one little-endian file, a 24-byte header
``u32 magic 0x4C4F5241, u32 version 1, u32 rank, f32 alpha, u32 numLayers, u32 0``,
then for each decoder layer, as row-major float32:
``Q_A`` = q_proj lora_A [r, dim], ``Q_B`` = q_proj lora_B [dim, r],
``V_A`` = v_proj lora_A [r, dim], ``V_B`` = v_proj lora_B [kvDim, r],
where dim is q_proj's in_features (the hidden size) and kvDim is v_proj's out_features.
It holds exactly Q and V adapters in every layer with one rank; dropout is not stored.

Loading into a model without adapters applies them first (``apply_lora`` with the
file's r, lora_alpha, targets and, for PEFT, lora_dropout). Into a model that has
adapters, the file's modules and rank must match them; their lora_A, lora_B and
lora_alpha (hence scaling) are replaced. Every check runs before any parameter changes.

Writes are atomic. A Hesper file is written to a temporary file in the same folder,
synced, and renamed over the target. A PEFT folder gets both files serialised in
memory, then written to temporary files and synced; only then is the old
``adapter_config.json`` removed, ``adapter_model.safetensors`` replaced, and the new
``adapter_config.json`` renamed into place (syncing the folder after each step). So a
failure before the commit (an exception, a full disk, a crash) leaves the previous
adapter untouched, and a crash inside the commit leaves a folder without
``adapter_config.json``, which peft and ``load_adapter`` both refuse: the pair on disk is
never a mix of old and new. (A reader that runs concurrently with a save may still read
one old and one new file; don't load from a folder while saving into it.)
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..modules import LoRALinear
from .bitnet import apply_lora, is_linear_like, layer_index, lora_modules

FORMATS = ("peft", "hesper")

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_WEIGHTS_NAME = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."
_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")

HESPER_MAGIC = 0x4C4F5241
HESPER_VERSION = 1
_HESPER_HEADER = struct.Struct("<IIIfII")  # magic, version, rank, alpha, numLayers, reserved (0)
HESPER_TARGETS = ("q_proj", "v_proj")

# PEFT options that make the model something other than base + (alpha/r)·B·A on the
# targeted linear layers; each is refused unless its value is off (None, False, "none", empty).
_PEFT_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "use_rslora": "rank-stabilised scaling alpha/sqrt(r) (use_rslora)",
    "bias": "trained biases (bias)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "fan_in_fan_out": "transposed (Conv1D) base weights (fan_in_fan_out)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
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
# Options that only matter before training (initialisation) or pick which modules carry
# adapters (the tensor keys say that exactly): any value is fine.
_PEFT_HARMLESS = {
    "peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules",
    "layers_to_transform", "layers_pattern", "init_lora_weights", "loftq_config", "eva_config",
    "corda_config", "lora_ga_config", "megatron_core", "qalora_group_size", "ensure_weight_tying",
}


def _is_off(value: Any) -> bool:
    return value is None or value is False or value in ("none", "") or (isinstance(value, (dict, list)) and not value)


@dataclass
class _Adapter:
    """What a file describes, checked against the model before any tensor is read."""

    r: int
    lora_alpha: float
    lora_dropout: float | None  # None: not stored (Hesper); adapters applied here get 0.0
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # module -> (lora_A shape, lora_B shape)


# -- public API --------------------------------------------------------------------------------

def save_adapter(model: nn.Module, path: str | os.PathLike, format: str = "peft",
                 base_model_name_or_path: str | None = None) -> Path:
    """Write ``model``'s LoRA adapters to ``path`` atomically; returns ``path``.

    ``format="peft"``: ``path`` is a folder (created if needed) that ``PeftModel.from_pretrained``
    loads. ``base_model_name_or_path`` defaults to ``model.config._name_or_path``.
    ``format="hesper"``: ``path`` is Hesper's binary file (Q and V adapters of every layer).

    >>> # apply_lora(model, r=8, lora_alpha=16); ...train...
    >>> # save_adapter(model, "out/adapter")
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    path = Path(path)
    modules = lora_modules(model)
    if not modules:
        raise ValueError("the model has no LoRA adapters to save (call apply_lora first)")
    if format == "peft":
        _save_peft(model, modules, path, base_model_name_or_path)
    else:
        _save_hesper(model, modules, path)
    return path


def load_adapter(model: nn.Module, path: str | os.PathLike, format: str | None = None) -> nn.Module:
    """Load the adapter at ``path`` into ``model`` (changed in place, and returned).

    ``format=None`` detects it: a folder is PEFT, a file starting with Hesper's magic is Hesper.

    >>> # model = load_adapter(BitNetForCausalLM.from_pretrained(base), "out/adapter")
    """
    path = Path(path)
    format = _detect_format(path) if format is None else format
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS} or None, got {format!r}")
    read = _read_peft if format == "peft" else _read_hesper
    adapter, targets, tensors = read(model, path)
    _install(model, adapter, targets, tensors)
    return model


# -- checks shared by both formats --------------------------------------------------------------

def _uniform(modules: dict[str, LoRALinear], what: str, value: Any, fix: str) -> Any:
    values = {name: value(m) for name, m in modules.items()}
    distinct = sorted(set(values.values()))
    if len(distinct) > 1:
        examples = {v: next(n for n in values if values[n] == v) for v in distinct}
        raise ValueError(f"the adapters do not share one {what}: " +
                         ", ".join(f"{n} has {v}" for v, n in examples.items()) + f"; {fix}")
    return distinct[0]


def _dropout_p(m: LoRALinear) -> float:
    return float(m.lora_dropout.p) if isinstance(m.lora_dropout, nn.Dropout) else 0.0


def _check_scaling(modules: dict[str, LoRALinear]) -> None:
    for name, m in modules.items():
        if m.scaling != m.lora_alpha / m.r:
            raise ValueError(f"{name}.scaling is {m.scaling}, not lora_alpha / r = {m.lora_alpha / m.r}: "
                             "adapter files store r and lora_alpha only")


def _fit(model: nn.Module, adapter: _Adapter, source: str) -> tuple[str, ...] | None:
    """Check ``adapter`` against ``model``; return the targets to apply, or None when the model has them."""
    named = dict(model.named_modules())
    for name, (a_shape, b_shape) in adapter.shapes.items():
        module = named.get(name)
        if module is None or not is_linear_like(module):
            raise ValueError(f"{source}: the adapter targets {name!r}, but this model has no linear module of "
                             "that name (was it made for another architecture?)")
        want_a, want_b = (adapter.r, module.in_features), (module.out_features, adapter.r)
        if (a_shape, b_shape) != (want_a, want_b):
            raise ValueError(f"{source}: {name} has lora_A {list(a_shape)} and lora_B {list(b_shape)}, but this "
                             f"model's {name} ({module.in_features} -> {module.out_features}) needs lora_A "
                             f"{list(want_a)} and lora_B {list(want_b)}: the adapter was made for another model size")
    wanted = set(adapter.shapes)
    existing = lora_modules(model)
    if existing:
        if set(existing) != wanted:
            raise ValueError(f"{source}: the model's adapters do not match the file's: only in the model "
                             f"{sorted(set(existing) - wanted)[:4]}, only in the file {sorted(wanted - set(existing))[:4]}")
        for name, m in existing.items():
            if m.r != adapter.r:
                raise ValueError(f"{source}: the model's adapter {name} has rank {m.r}, the file's has rank {adapter.r}")
            if m.merged:
                raise ValueError(f"{source}: the model's adapter {name} is merged into its base weight; "
                                 "unmerge() it before loading new adapter weights")
        return None
    targets = tuple(sorted({name.rsplit(".", 1)[-1] for name in wanted}))
    would_wrap = {n for n, m in named.items() if n and n.rsplit(".", 1)[-1] in targets and is_linear_like(m)}
    if would_wrap != wanted:
        raise ValueError(f"{source}: the adapter has no weights for {sorted(would_wrap - wanted)[:4]}, but "
                         f"adapters are applied to every module named {list(targets)}")
    return targets


@torch.no_grad()
def _install(model: nn.Module, adapter: _Adapter, targets: tuple[str, ...] | None,
             tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    if targets is not None:
        # init="peft" is the fast one; every value is overwritten below.
        apply_lora(model, r=adapter.r, lora_alpha=adapter.lora_alpha, target_modules=targets,
                   lora_dropout=adapter.lora_dropout or 0.0, init="peft")
        for m in lora_modules(model).values():
            m.train(model.training)  # new modules start in training mode; follow the model's (dropout)
    modules = lora_modules(model)
    for name, (A, B) in tensors.items():
        m = modules[name]
        m.lora_A.copy_(A)
        m.lora_B.copy_(B)
        m.lora_alpha = adapter.lora_alpha
        m.scaling = adapter.lora_alpha / m.r


# -- atomic writes ------------------------------------------------------------------------------

def _write_temp(directory: Path, name: str, data: bytes) -> Path:
    """``data`` in a new synced temporary file beside ``directory/name``."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)


def _sync_dir(directory: Path) -> None:
    """Make renames and removals in ``directory`` durable (a no-op where folders can't be opened)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = _write_temp(path.parent, path.name, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    _sync_dir(path.parent)


# -- PEFT ----------------------------------------------------------------------------------------

def _peft_config(model: nn.Module, modules: dict[str, LoRALinear], base_model_name_or_path: str | None) -> dict:
    r = _uniform(modules, "rank", lambda m: m.r, "PEFT files need rank_pattern for that, which is not supported")
    alpha = _uniform(modules, "lora_alpha", lambda m: m.lora_alpha,
                     "PEFT files need alpha_pattern for that, which is not supported")
    dropout = _uniform(modules, "lora_dropout", _dropout_p, "a PEFT config has one lora_dropout")
    _check_scaling(modules)
    targets = sorted({name.rsplit(".", 1)[-1] for name in modules})
    same_named = {n for n, m in model.named_modules() if n and n.rsplit(".", 1)[-1] in targets and is_linear_like(m)}
    if same_named != set(modules):
        raise ValueError(f"PEFT's target_modules {targets} would also put adapters on {sorted(same_named - set(modules))[:4]}, "
                         "which have none here; PEFT files cannot express adapters on only some modules of a name")
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    # The fields a LoraConfig saves (peft >= 0.19), at their plain-LoRA values; peft fills the rest with defaults.
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "revision": None, "inference_mode": True, "r": r,
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha, "lora_dropout": dropout,
        "target_modules": targets, "exclude_modules": None, "bias": "none", "lora_bias": False,
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }


def _save_peft(model: nn.Module, modules: dict[str, LoRALinear], folder: Path, base_model_name_or_path: str | None) -> None:
    from safetensors.torch import save as safetensors_bytes

    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file; format='peft' writes a folder (adapter_config.json and "
                         f"{WEIGHTS_NAME})")
    config = _peft_config(model, modules, base_model_name_or_path)
    tensors = {}
    for name, m in modules.items():
        tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.detach().float().contiguous()
        tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.detach().float().contiguous()
    weights = safetensors_bytes(tensors, metadata={"format": "pt"})
    config_text = json.dumps(config, indent=2, sort_keys=True).encode()

    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    temps: list[Path] = []
    try:
        temps.append(_write_temp(folder, WEIGHTS_NAME, weights))
        temps.append(_write_temp(folder, CONFIG_NAME, config_text))
        # Commit. The config goes first and comes back last, so a crash in between leaves no
        # config (an unloadable folder), never the old config beside the new weights.
        (folder / CONFIG_NAME).unlink(missing_ok=True)
        _sync_dir(folder)
        os.replace(temps[0], folder / WEIGHTS_NAME)
        _sync_dir(folder)
        os.replace(temps[1], folder / CONFIG_NAME)
        _sync_dir(folder)
    except BaseException:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        if created:
            folder.rmdir()
        raise


def _read_peft_config(folder: Path) -> dict:
    config_path = folder / CONFIG_NAME
    if not (folder / WEIGHTS_NAME).is_file():
        if (folder / PICKLE_WEIGHTS_NAME).is_file():
            raise ValueError(f"{folder} holds {PICKLE_WEIGHTS_NAME}, a pickle, and no {WEIGHTS_NAME}. Unpickling "
                             "can run arbitrary code, so torch_wgpu_lora never does; convert it where you trust "
                             "the file: PeftModel.from_pretrained(base, folder).save_pretrained(out) writes safetensors")
        raise ValueError(f"{folder} has no {WEIGHTS_NAME}: not a PEFT adapter folder")
    if not config_path.is_file():
        raise ValueError(f"{folder} has no {CONFIG_NAME}: not a PEFT adapter folder (or a save into it "
                         "was interrupted)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} holds a JSON {type(config).__name__}, not an object")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{config_path}: peft_type is {config.get('peft_type')!r}; only LoRA adapters "
                         "(peft_type 'LORA') can be loaded")
    for key, value in config.items():
        if key in _PEFT_UNSUPPORTED and not _is_off(value):
            raise ValueError(f"{config_path}: {key}={value!r} asks for {_PEFT_UNSUPPORTED[key]}, which "
                             "torch_wgpu_lora does not implement; loading it would give a different model")
        if key not in _PEFT_UNSUPPORTED and key not in _PEFT_HARMLESS and not _is_off(value):
            raise ValueError(f"{config_path}: unknown option {key}={value!r} (from a newer peft?); it may "
                             "change the model in a way torch_wgpu_lora cannot reproduce, so it is refused")
    r, alpha, dropout = config.get("r"), config.get("lora_alpha"), config.get("lora_dropout", 0.0)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{config_path}: r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{config_path}: lora_alpha must be a finite number, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"{config_path}: lora_dropout must be a number in [0, 1), got {dropout!r}")
    return config


_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _read_peft(model: nn.Module, folder: Path):
    from safetensors import SafetensorError, safe_open

    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder; a PEFT adapter is a folder holding {CONFIG_NAME} and "
                         f"{WEIGHTS_NAME}")
    config = _read_peft_config(folder)
    weights_path = folder / WEIGHTS_NAME
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            shapes: dict[str, dict[str, tuple[int, ...]]] = {}
            for key in f.keys():
                header = f.get_slice(key)  # shape and dtype only; no data is read yet
                shape, dtype = tuple(header.get_shape()), header.get_dtype()
                match = _PEFT_KEY.match(key)
                if match is None:
                    raise ValueError(f"{weights_path}: tensor {key!r} is not a lora_A/lora_B weight; extra tensors "
                                     "(DoRA magnitudes, biases, embeddings, modules_to_save) change the model in ways "
                                     "torch_wgpu_lora cannot reproduce")
                if dtype not in _FLOAT_DTYPES:
                    raise ValueError(f"{weights_path}: tensor {key!r} has dtype {dtype}; expected one of {_FLOAT_DTYPES}")
                shapes.setdefault(match["module"], {})[match["which"]] = shape
            if not shapes:
                raise ValueError(f"{weights_path} holds no LoRA weights")
            for module, pair in shapes.items():
                if set(pair) != {"A", "B"}:
                    missing = "lora_B" if "A" in pair else "lora_A"
                    raise ValueError(f"{weights_path}: {module} has no {missing} weight")
                if len(pair["A"]) != 2 or len(pair["B"]) != 2 or pair["A"][0] != config["r"] or pair["B"][1] != config["r"]:
                    raise ValueError(f"{weights_path}: {module} has lora_A {list(pair['A'])} and lora_B "
                                     f"{list(pair['B'])}, which is not rank r={config['r']} from {CONFIG_NAME}")
            adapter = _Adapter(config["r"], float(config["lora_alpha"]), float(config.get("lora_dropout", 0.0)),
                               {module: (pair["A"], pair["B"]) for module, pair in shapes.items()})
            targets = _fit(model, adapter, str(folder))
            tensors = {module: (f.get_tensor(f"{PEFT_PREFIX}{module}.lora_A.weight"),
                                f.get_tensor(f"{PEFT_PREFIX}{module}.lora_B.weight")) for module in shapes}
    except SafetensorError as err:
        raise ValueError(f"{weights_path} is not a valid safetensors file: {err}") from None
    return adapter, targets, tensors


# -- Hesper --------------------------------------------------------------------------------------

def _hesper_projections(model: nn.Module) -> list[tuple[tuple[str, nn.Module], tuple[str, nn.Module]]]:
    """(q_proj, v_proj) as (name, module) for decoder layers 0..L-1, with Hesper's shape rules checked."""
    found: dict[str, dict[int, tuple[str, nn.Module]]] = {t: {} for t in HESPER_TARGETS}
    for name, module in model.named_modules():
        target = name.rsplit(".", 1)[-1]
        if target in found and is_linear_like(module):
            index = layer_index(name)
            if index is not None:
                found[target][index] = (name, module)
    q_layers, v_layers = sorted(found["q_proj"]), sorted(found["v_proj"])
    if not q_layers or q_layers != list(range(len(q_layers))) or v_layers != q_layers:
        raise ValueError("the Hesper format needs q_proj and v_proj in every decoder layer 0..L-1; this model has "
                         f"q_proj in layers {q_layers} and v_proj in layers {v_layers}")
    pairs = [(found["q_proj"][i], found["v_proj"][i]) for i in q_layers]
    dim, kv_dim = pairs[0][0][1].in_features, pairs[0][1][1].out_features
    for (q_name, q), (v_name, v) in pairs:
        if (q.in_features, q.out_features, v.in_features, v.out_features) != (dim, dim, dim, kv_dim):
            raise ValueError(f"the Hesper format needs q_proj {dim} -> {dim} and v_proj {dim} -> {kv_dim} in every "
                             f"layer; {q_name} is {q.in_features} -> {q.out_features} and {v_name} is "
                             f"{v.in_features} -> {v.out_features}")
    return pairs


def _save_hesper(model: nn.Module, modules: dict[str, LoRALinear], path: Path) -> None:
    if path.is_dir():
        raise ValueError(f"{path} is a folder; format='hesper' writes one file")
    pairs = _hesper_projections(model)
    qv_names = {name for pair in pairs for name, _ in pair}
    if set(modules) != qv_names:
        raise ValueError("the Hesper format holds exactly the q_proj and v_proj adapters of every layer; this "
                         f"model has adapters on {sorted(set(modules) - qv_names)[:4]} too and none on "
                         f"{sorted(qv_names - set(modules))[:4]}")
    r = _uniform(modules, "rank", lambda m: m.r, "the Hesper format has one rank")
    alpha = _uniform(modules, "lora_alpha", lambda m: m.lora_alpha, "the Hesper format has one alpha")
    _check_scaling(modules)
    if float(np.float32(alpha)) != alpha:
        raise ValueError(f"lora_alpha={alpha!r} is not exactly a float32, which the Hesper header stores; "
                         "use a value float32 holds exactly (e.g. an integer)")
    parts = [_HESPER_HEADER.pack(HESPER_MAGIC, HESPER_VERSION, r, alpha, len(pairs), 0)]
    for (q_name, _), (v_name, _) in pairs:
        for m in (modules[q_name], modules[v_name]):
            parts.append(m.lora_A.detach().float().numpy().astype("<f4").tobytes())
            parts.append(m.lora_B.detach().float().numpy().astype("<f4").tobytes())
    _write_atomic(path, b"".join(parts))


def _read_hesper(model: nn.Module, path: Path):
    if not path.is_file():
        raise ValueError(f"{path} is not a file; a Hesper adapter is one binary file")
    with open(path, "rb") as f:
        header = f.read(_HESPER_HEADER.size)
        if len(header) < _HESPER_HEADER.size:
            raise ValueError(f"{path}: {len(header)} bytes, shorter than the {_HESPER_HEADER.size}-byte Hesper header")
        magic, version, r, alpha, num_layers, reserved = _HESPER_HEADER.unpack(header)
        if magic != HESPER_MAGIC:
            raise ValueError(f"{path}: magic is 0x{magic:08X}, not Hesper's 0x{HESPER_MAGIC:08X}: not a Hesper adapter")
        if version != HESPER_VERSION:
            raise ValueError(f"{path}: Hesper format version {version}; only version {HESPER_VERSION} is supported")
        if reserved != 0:
            raise ValueError(f"{path}: the header's reserved field is {reserved}, not 0")
        if r < 1:
            raise ValueError(f"{path}: rank is {r}; it must be at least 1")
        if not math.isfinite(alpha):
            raise ValueError(f"{path}: alpha is {alpha}, not a finite number")
        pairs = _hesper_projections(model)
        if num_layers != len(pairs):
            raise ValueError(f"{path}: the adapter has {num_layers} layers, this model has {len(pairs)}")
        dim, kv_dim = pairs[0][0][1].in_features, pairs[0][1][1].out_features
        per_layer = r * dim + dim * r + r * dim + kv_dim * r
        expected = _HESPER_HEADER.size + 4 * num_layers * per_layer
        size = os.fstat(f.fileno()).st_size
        if size != expected:
            gap = f"{expected - size} bytes short" if size < expected else f"{size - expected} bytes too many"
            raise ValueError(f"{path}: {size} bytes ({gap}); a rank-{r} Hesper adapter for this model "
                             f"({num_layers} layers, dim={dim}, kvDim={kv_dim}) is {expected} bytes: the file is "
                             "truncated, or was made for a model with other dimensions")
        shapes = {}
        for (q_name, _), (v_name, _) in pairs:
            shapes[q_name] = ((r, dim), (dim, r))
            shapes[v_name] = ((r, dim), (kv_dim, r))
        adapter = _Adapter(r, float(alpha), None, shapes)
        targets = _fit(model, adapter, str(path))
        values = torch.from_numpy(np.frombuffer(bytearray(f.read()), dtype="<f4").astype(np.float32, copy=False))
    tensors, offset = {}, 0
    for name, (a_shape, b_shape) in shapes.items():
        a_size, b_size = math.prod(a_shape), math.prod(b_shape)
        tensors[name] = (values[offset:offset + a_size].view(a_shape),
                         values[offset + a_size:offset + a_size + b_size].view(b_shape))
        offset += a_size + b_size
    return adapter, targets, tensors


def _detect_format(path: Path) -> str:
    if path.is_dir():
        return "peft"
    if not path.exists():
        raise FileNotFoundError(f"no adapter at {path}")
    with open(path, "rb") as f:
        head = f.read(4)
    if len(head) == 4 and struct.unpack("<I", head)[0] == HESPER_MAGIC:
        return "hesper"
    raise ValueError(f"{path} is neither a PEFT adapter folder (pass the folder holding {CONFIG_NAME}) nor a "
                     f"Hesper adapter file (magic 0x{HESPER_MAGIC:08X})")
