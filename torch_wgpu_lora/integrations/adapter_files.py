"""Adapter files: PEFT's folder layout and Hesper's binary format, written and read; GGUF, written.

>>> # save_adapter(model, "out/adapter")                      # PEFT folder
>>> # PeftModel.from_pretrained(base, "out/adapter")          # real peft loads it
>>> # load_adapter_file(BitNetForCausalLM.from_pretrained(p), "out/adapter")   # ours, or one trained by peft
>>> # save_adapter(model, "out/adapter.lora", format="hesper")           # Hesper's binary file
>>> # save_adapter(model, "out/adapter.gguf", format="gguf")             # llama.cpp's LoRA GGUF (written only)

**PEFT** (``format="peft"``): a folder holding ``adapter_model.safetensors``, with keys
``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r]
(for example ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), and
``adapter_config.json`` (peft_type "LORA", task_type "CAUSAL_LM", r, lora_alpha,
lora_dropout, target_modules, ...), as ``PeftModel.save_pretrained`` writes them.
Loading also takes adapters that peft trained, as long as they describe LoRA as this
package runs it (per-module ranks and alphas, rsLoRA and adapters on some layers only
included): options that change the model in other ways (DoRA, biases, modules_to_save, ...)
are refused by name (``LoraConfig.from_peft_fields``), and so is any option this module does
not know whose value is not off, and so are target fields (``target_modules``,
``exclude_modules``, ``layers_to_transform``) that disagree with the modules the tensors
adapt. An adapter whose initialisation changed the base weights (PiSSA, OLoRA, ...) is
refused unless the model is that changed base (``residual_base=True``).
``adapter_model.bin`` is a pickle and is refused: loading never unpickles. Saving writes
rank_pattern / alpha_pattern where the adapters' ranks or alphas differ, and the exact
module names as target_modules where the adapters cover only some modules of a name.

**Hesper** (``format="hesper"``): one little-endian file, a 24-byte header
``u32 magic 0x4C4F5241, u32 version 1, u32 rank, f32 alpha, u32 numLayers, u32 reserved``,
then for each decoder layer, as row-major float32:
``Q_A`` = q_proj lora_A [r, dim], ``Q_B`` = q_proj lora_B [dim, r],
``V_A`` = v_proj lora_A [r, dim], ``V_B`` = v_proj lora_B [kvDim, r],
where dim is q_proj's in_features (the hidden size) and kvDim is v_proj's out_features.
It holds exactly Q and V adapters in every layer with one rank; dropout is not stored.

**GGUF** (``format="gguf"``, written only): a LoRA adapter GGUF that llama.cpp loads with
``--lora`` and runs as this package runs the adapters (rsLoRA and files whose gate/up carry
``.scale`` tensors included), with one alpha for all modules; ``integrations.gguf`` describes it.

**Integrity.** Files we write carry a checksum, so that a damaged file (a flipped bit on
disk, a bad copy) is refused rather than loaded into different generations: PEFT weights
have the SHA-256 of their tensors (names, dtypes, shapes and bytes, in name order) in the
safetensors metadata (``torch_wgpu_lora_sha256``), Hesper files the CRC-32 of everything
but the reserved field in the reserved field (Hesper writes 0 there and never reads it).
Files without one (written by peft or Hesper, or a Hesper CRC that happens to be 0) load
unchecked. Any file whose tensors hold NaN or Inf is refused.

Both formats are written from, and read into, a ``LoraConfig`` (r, lora_alpha, targets,
and for PEFT lora_dropout, patterns and rsLoRA). Loading into a model without adapters
applies them first, to exactly the modules the file holds weights for. Into a model that has
adapters, the file's modules and ranks must match them; their lora_A, lora_B and lora_alpha
(hence scaling) are replaced.
Every check runs before any parameter changes.

Writes are atomic. A Hesper file is written to a temporary file in the same folder,
synced, and renamed over the target. A new PEFT folder is filled under a temporary name
and renamed into place whole. Into an existing one, both files are serialised in memory,
then written to temporary files and synced; only then is the old ``adapter_config.json``
removed, ``adapter_model.safetensors`` replaced, and the new ``adapter_config.json``
renamed into place (syncing the folder after each step). So a failure before the commit
(an exception, a full disk, a crash) leaves the previous adapter untouched, and a crash
inside the commit leaves a folder without ``adapter_config.json``, which peft and
``load_adapter_file`` both refuse: the pair on disk is never a mix of old and new.

Reading while saves run: a save's commit holds an exclusive lock on the folder (``flock``),
and ``load_adapter_file`` reads both files once, whole, under a shared one, so it gets one whole
save, and two saves at once commit one after the other. Our weights also record the config
fields they were saved with (r, lora_alpha, lora_dropout, the target fields, the patterns and
use_rslora; ``PAIRING_KEY`` in the safetensors metadata): where folders cannot be locked
(outside POSIX, some network filesystems), a read that meets a save half done is refused,
saying the folder was being written. (peft's own loader takes no lock and has no such check: don't point it at a folder
that is being saved into.)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config import LoraConfig
from ..files import locked_dir, make_temp_dir, sync_dir, write_atomic, write_temp
from ..modules import LoRALinear
from .bitnet import add_lora_layers, is_linear_like, layer_index, lora_modules, lora_targets
from .gguf import llama_cpp_alpha, save_gguf_adapter

FORMATS = ("peft", "hesper")
SAVE_FORMATS = (*FORMATS, "gguf")  # GGUF LoRA adapters are written for llama.cpp (integrations.gguf)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_WEIGHTS_NAME = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."
CHECKSUM_KEY = "torch_wgpu_lora_sha256"  # safetensors metadata: our PEFT weights' checksum
PAIRING_KEY = "torch_wgpu_lora_config"  # safetensors metadata: the config fields the weights were saved with
_PAIRED_FIELDS = ("r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "layers_to_transform",
                  "layers_pattern", "rank_pattern", "alpha_pattern", "use_rslora")
_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")

HESPER_MAGIC = 0x4C4F5241
HESPER_VERSION = 1
_HESPER_HEADER = struct.Struct("<IIIfII")  # magic, version, rank, alpha, numLayers, reserved (our CRC-32)
_HESPER_CHECKED = 20  # header bytes before the reserved field, which the CRC covers with the tensors
HESPER_TARGETS = ("q_proj", "v_proj")

@dataclass
class _Adapter:
    """What a file describes, checked against the model before any tensor is read."""

    config: LoraConfig  # as the file describes it (ranks: the shapes')
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # module -> (lora_A shape, lora_B shape)


# -- public API --------------------------------------------------------------------------------

def save_adapter(model: nn.Module, path: str | os.PathLike, format: str = "peft",
                 base_model_name_or_path: str | None = None) -> Path:
    """Write ``model``'s LoRA adapters to ``path`` atomically; returns ``path``.

    ``format="peft"``: ``path`` is a folder (created if needed) that ``PeftModel.from_pretrained``
    loads. ``base_model_name_or_path`` defaults to ``model.config._name_or_path``.
    ``format="hesper"``: ``path`` is Hesper's binary file (Q and V adapters of every layer).
    ``format="gguf"``: ``path`` is a LoRA adapter GGUF for llama.cpp (``integrations.gguf``).

    >>> # apply_lora(model, r=8, lora_alpha=16); ...train...
    >>> # save_adapter(model, "out/adapter")
    """
    if format not in SAVE_FORMATS:
        raise ValueError(f"format must be one of {SAVE_FORMATS}, got {format!r}")
    path = Path(path)
    modules = lora_modules(model)
    if not modules:
        raise ValueError("the model has no LoRA adapters to save (call apply_lora first)")
    if format == "peft":
        _save_peft(model, modules, path, base_model_name_or_path)
    elif format == "hesper":
        _save_hesper(model, modules, path)
    else:
        _check_scaling(modules)
        save_gguf_adapter(model, modules, path, _uniform(
            modules, "llama.cpp alpha (lora_alpha, or lora_alpha·√r under rsLoRA)", llama_cpp_alpha,
            "a GGUF adapter has one alpha (adapter.lora.alpha), by which llama.cpp scales each module / r"))
    return path


def load_adapter_file(model: nn.Module, path: str | os.PathLike, format: str | None = None, *,
                 residual_base: bool = False) -> nn.Module:
    """Load the adapter at ``path`` into ``model`` (changed in place, and returned): the file's part of
    ``torch_wgpu_lora.load_adapter``, which also gives the model PEFT's model API.

    ``format=None`` detects it: a folder is PEFT, a file starting with Hesper's magic is Hesper.
    Anything but a regular file or a folder (a FIFO, a device) is refused before it is opened.
    ``residual_base=True`` says that ``model``'s base weights are the ones peft changed when it
    initialised this adapter (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA), which such adapters need.

    >>> # model = load_adapter_file(BitNetForCausalLM.from_pretrained(base), "out/adapter")
    """
    path = check_adapter_path(path)
    format = _detect_format(path) if format is None else format
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS} or None, got {format!r}")
    if format == "peft":
        adapter, targets, tensors = _read_peft(model, path, residual_base)
    else:
        adapter, targets, tensors = _read_hesper(model, path)
    _install(model, adapter, targets, tensors)
    return model


def check_adapter_path(path: str | os.PathLike) -> Path:
    """``path`` as a Path if something that may be an adapter is there: a folder or a regular file.

    FileNotFoundError when nothing is; ValueError for a FIFO, socket or device, which reading
    could block on forever.

    >>> # check_adapter_path("run/adapter")  # before loading a large model for it
    """
    path = Path(path)
    if not path.is_dir() and not path.is_file():
        if not path.exists():
            raise FileNotFoundError(f"no adapter at {path} (a PEFT folder or a Hesper .lora file)")
        raise ValueError(f"{path} is neither a regular file nor a folder (a FIFO, socket or device?); an adapter "
                         "is a PEFT folder or a Hesper .lora file")
    return path


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
        expected = LoraConfig(r=m.r, lora_alpha=m.lora_alpha, use_rslora=m.use_rslora).scaling
        if m.scaling != expected:
            rule = "lora_alpha / sqrt(r)" if m.use_rslora else "lora_alpha / r"
            raise ValueError(f"{name}.scaling is {m.scaling}, not {rule} = {expected}: adapter files store r, "
                             "lora_alpha and use_rslora only")


def _file_config(source: Any, **fields: Any) -> LoraConfig:
    """The LoraConfig a file describes; a value LoraConfig refuses is reported with the file's name."""
    try:
        return LoraConfig(**fields)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


def _check_finite(source: Any, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    for name, pair in tensors.items():
        for which, tensor in zip("AB", pair):
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise ValueError(f"{source}: {name}.lora_{which} holds {bad} NaN or infinite values; the adapter is "
                                 "broken (did its training diverge?) and would make every output NaN")


def _fit(model: nn.Module, adapter: _Adapter, source: str) -> tuple[str, ...] | None:
    """Check ``adapter`` against ``model``; return the modules to put adapters on, or None when the
    model has them."""
    named = dict(model.named_modules())
    for name, (a_shape, b_shape) in adapter.shapes.items():
        module = named.get(name)
        if module is None or not is_linear_like(module):
            raise ValueError(f"{source}: the adapter targets {name!r}, but this model has no linear module of "
                             "that name (was it made for another architecture?)")
        r = a_shape[0]
        want_a, want_b = (r, module.in_features), (module.out_features, r)
        if (a_shape, b_shape) != (want_a, want_b):
            raise ValueError(f"{source}: {name} has lora_A {list(a_shape)} and lora_B {list(b_shape)}, but this "
                             f"model's {name} ({module.in_features} -> {module.out_features}) needs lora_A "
                             f"{list(want_a)} and lora_B {list(want_b)}: the adapter was made for another model size")
    wanted = set(adapter.shapes)
    existing = lora_modules(model)
    _check_targets(model, adapter.config, wanted, existing, source)
    if existing:
        if set(existing) != wanted:
            raise ValueError(f"{source}: the model's adapters do not match the file's: only in the model "
                             f"{sorted(set(existing) - wanted)[:4]}, only in the file {sorted(wanted - set(existing))[:4]}")
        for name, m in existing.items():
            r = adapter.shapes[name][0][0]
            if m.r != r:
                raise ValueError(f"{source}: the model's adapter {name} has rank {m.r}, the file's has rank {r}")
            if m.merged:
                raise ValueError(f"{source}: the model's adapter {name} is merged into its base weight; "
                                 "unmerge() it before loading new adapter weights")
        return None
    return tuple(adapter.shapes)


def _check_targets(model: nn.Module, config: LoraConfig, wanted: set[str], existing: dict[str, LoRALinear],
                   source: str) -> None:
    """Refuse a file whose target fields select other modules of ``model`` than those its tensors
    adapt (``wanted``): peft would load such a pair as another model, leaving tensors unused or
    adding untrained adapters. ``existing``: the model's adapters, whose base layers are no targets."""
    inside = tuple(f"{name}." for name in existing)
    try:
        selected = {n for n, _ in lora_targets(model, config) if not n.startswith(inside)}
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    unselected, unloaded = sorted(wanted - selected), sorted(selected - wanted)
    if not unselected and not unloaded:
        return
    fields = "".join(f", {key}={getattr(config, key)!r}" for key in ("exclude_modules", "layers_to_transform")
                     if getattr(config, key) is not None)
    found = sorted({m.rsplit(".", 1)[-1] for m in wanted})
    problems = ([f"they hold weights for {unselected[:4]}, which target_modules does not select (peft would leave "
                 "them unused)"] if unselected else []) + \
               ([f"target_modules selects {unloaded[:4]}, which they hold no weights for (peft would add untrained "
                 "adapters there)"] if unloaded else [])
    raise ValueError(f"{source}: target_modules {config.target_modules!r}{fields} disagree with the file's tensors, "
                     f"which adapt {found}: " + "; ".join(problems))


@torch.no_grad()
def _install(model: nn.Module, adapter: _Adapter, targets: tuple[str, ...] | None,
             tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    config = adapter.config
    if targets is not None:
        # Exactly the file's modules, whatever its target fields say; init="peft" is the fast one
        # (every value is overwritten below).
        exact = "(?:" + "|".join(re.escape(name) for name in targets) + ")"
        add_lora_layers(model, config.updated(target_modules=exact, exclude_modules=None, layers_to_transform=None,
                                              layers_pattern=None, init="peft"))
        model.lora_config = config
        for m in lora_modules(model).values():
            m.train(model.training)  # new modules start in training mode; follow the model's (dropout)
    elif getattr(model, "lora_config", None) is not None:
        model.lora_config = model.lora_config.updated(lora_alpha=config.lora_alpha, alpha_pattern=config.alpha_pattern,
                                                      use_rslora=config.use_rslora)
    modules = lora_modules(model)
    for name, (A, B) in tensors.items():
        m = modules[name]
        m.lora_A.copy_(A)
        m.lora_B.copy_(B)
        m.lora_alpha = config.alpha_of(name)
        m.use_rslora = config.use_rslora
        m.scaling = config.scaling_of(name)


# -- PEFT ----------------------------------------------------------------------------------------

def _by_module(model: nn.Module, modules: dict[str, LoRALinear], value: Any, default: Any) -> dict[str, Any]:
    """PEFT's pattern for the modules whose ``value`` is not ``default``: keyed by the module's last
    name where every adapter of that name has the value, else by its escaped qualified name."""
    out = {}
    for name, m in modules.items():
        if value(m) == default:
            continue
        short = name.rsplit(".", 1)[-1]
        same_named = [other for n, other in modules.items() if n.rsplit(".", 1)[-1] == short]
        out[short if all(value(o) == value(m) for o in same_named) else re.escape(name)] = value(m)
    return out


def _most_common(values: list[Any]) -> Any:
    return max(sorted(set(values)), key=values.count)


def _peft_lora_config(model: nn.Module, modules: dict[str, LoRALinear]) -> LoraConfig:
    dropout = _uniform(modules, "lora_dropout", _dropout_p, "a PEFT config has one lora_dropout")
    use_rslora = _uniform(modules, "scaling rule (use_rslora)", lambda m: m.use_rslora,
                          "a PEFT config has one use_rslora")
    _check_scaling(modules)
    r = _most_common([m.r for m in modules.values()])
    alpha = _most_common([m.lora_alpha for m in modules.values()])
    names = tuple(sorted({name.rsplit(".", 1)[-1] for name in modules}))
    same_named = {n for n, m in model.named_modules() if n and n.rsplit(".", 1)[-1] in names and is_linear_like(m)}
    # PEFT's target_modules names match every module of that name; where only some have adapters,
    # the qualified names themselves (PEFT takes a module that a name equals, too).
    targets = names if same_named == set(modules) else tuple(modules)
    return LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=dropout, use_rslora=use_rslora,
                      rank_pattern=_by_module(model, modules, lambda m: m.r, r),
                      alpha_pattern=_by_module(model, modules, lambda m: m.lora_alpha, alpha))


def _json_number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def _peft_config_json(config: LoraConfig, base_model_name_or_path: str | None) -> dict:
    """adapter_config.json for ``config``: the fields a peft LoraConfig saves (peft >= 0.19), at their
    plain-LoRA values where this package has no such option; peft fills the rest with defaults."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "revision": None, "inference_mode": True, "r": config.r,
        "lora_alpha": _json_number(config.lora_alpha), "lora_dropout": config.lora_dropout,
        "target_modules": list(config.target_modules), "exclude_modules": None, "bias": "none", "lora_bias": False,
        "fan_in_fan_out": False, "use_rslora": config.use_rslora, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": dict(config.rank_pattern),
        "alpha_pattern": {key: _json_number(value) for key, value in config.alpha_pattern.items()},
    }


def _sha256(tensors: dict[str, torch.Tensor]) -> str:
    """The checksum of a safetensors file's tensors: names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for key in sorted(tensors):
        tensor = tensors[key].contiguous()
        digest.update(f"{key}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        digest.update(tensor.view(torch.uint8).numpy())
    return digest.hexdigest()


def _pairing(config: dict) -> dict:
    """What a PEFT config and its weights must agree on: the fields ``load_adapter_file`` reads."""
    return {key: config.get(key) for key in _PAIRED_FIELDS}


def _commit_peft(folder: Path, weights_tmp: Path, config_tmp: Path) -> None:
    """Rename the new weights and config into ``folder``, holding its lock (other saves commit
    before or after, readers read before or after). The config goes first and comes back last,
    so a crash in between leaves no config (an unloadable folder, for peft too), never the old
    config beside the new weights."""
    with locked_dir(folder):
        (folder / CONFIG_NAME).unlink(missing_ok=True)
        sync_dir(folder)
        os.replace(weights_tmp, folder / WEIGHTS_NAME)
        sync_dir(folder)
        os.replace(config_tmp, folder / CONFIG_NAME)
        sync_dir(folder)


def _save_peft(model: nn.Module, modules: dict[str, LoRALinear], folder: Path, base_model_name_or_path: str | None) -> None:
    from safetensors.torch import save as safetensors_bytes

    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file; format='peft' writes a folder (adapter_config.json and "
                         f"{WEIGHTS_NAME})")
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    config = _peft_config_json(_peft_lora_config(model, modules), base_model_name_or_path)
    tensors = {}
    for name, m in modules.items():
        tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.detach().float().contiguous()
        tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.detach().float().contiguous()
    weights = safetensors_bytes(tensors, metadata={"format": "pt", CHECKSUM_KEY: _sha256(tensors),
                                                   PAIRING_KEY: json.dumps(_pairing(config), sort_keys=True)})
    config_text = json.dumps(config, indent=2, sort_keys=True).encode()

    # A new folder is filled under a temporary name and renamed into place whole.
    created = not folder.exists()
    if created:
        folder.parent.mkdir(parents=True, exist_ok=True)
    target = make_temp_dir(folder) if created else folder
    temps: list[Path] = []
    try:
        temps.append(write_temp(target, WEIGHTS_NAME, weights))
        temps.append(write_temp(target, CONFIG_NAME, config_text))
        if created:
            _commit_peft(target, *temps)
            try:
                os.rename(target, folder)
            except OSError:
                if not folder.is_dir():
                    raise
                # another save made the folder meanwhile: commit into it as into any existing one
                temps = [target / WEIGHTS_NAME, target / CONFIG_NAME]
                _commit_peft(folder, *temps)
                target.rmdir()
            sync_dir(folder.parent)
        else:
            _commit_peft(folder, *temps)
    except BaseException:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        if created and target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        raise


def _no_weights(folder: Path) -> ValueError:
    if (folder / "adapter" / CONFIG_NAME).is_file():
        return ValueError(f"{folder} is not an adapter folder but holds one (a training checkpoint or output "
                          f"folder?): pass {folder / 'adapter'}")
    if (folder / PICKLE_WEIGHTS_NAME).is_file():
        return ValueError(f"{folder} holds {PICKLE_WEIGHTS_NAME}, a pickle, and no {WEIGHTS_NAME}. Unpickling "
                          "can run arbitrary code, so torch_wgpu_lora never does; convert it where you trust "
                          "the file: PeftModel.from_pretrained(base, folder).save_pretrained(out) writes safetensors")
    return ValueError(f"{folder} has no {WEIGHTS_NAME}: not a PEFT adapter folder")


def _safetensors_header(path: Path, data: bytes) -> dict:
    """The JSON header of safetensors bytes: {name: {"dtype", "shape", ...}, "__metadata__": {...}}."""
    size = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    try:
        if not 0 < size <= len(data) - 8:
            raise ValueError(f"a header of {size} bytes in a file of {len(data)}")
        header = json.loads(data[8:8 + size])
        if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
            raise ValueError("the header is not a JSON object of objects")
    except ValueError as err:
        raise ValueError(f"{path} is not a valid safetensors file: {err}") from None
    return header


def _config_json(config_path: Path, text: bytes) -> dict:
    try:
        config = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} holds a JSON {type(config).__name__}, not an object")
    return config


def _read_peft_pair(folder: Path) -> tuple[dict, bytes, dict, str | None]:
    """(adapter_config.json, adapter_model.safetensors' bytes, its header, a disagreement) from one save.

    A save replaces the two files one after the other, holding the folder's exclusive lock;
    they are read under its shared lock, so both come from one save. Where folders cannot be
    locked a read can still meet a save half done: no config, or a config that is not the one
    the weights were saved with (our weights record its fields, ``PAIRING_KEY``). Such a
    disagreement is returned, to be refused after the checks that name a more specific fault
    (an edited value out of range, a rank the tensors do not have)."""
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    with locked_dir(folder, shared=True):
        try:
            data = weights_path.read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            raise _no_weights(folder) from None
        try:
            text = config_path.read_bytes()
        except FileNotFoundError:
            raise ValueError(f"{folder} has no {CONFIG_NAME}: not a PEFT adapter folder (or a save into it was "
                             "interrupted, or was being written while it was read)") from None
    header = _safetensors_header(weights_path, data)
    config = _config_json(config_path, text)
    saved = (header.get("__metadata__") or {}).get(PAIRING_KEY)
    if saved is None:  # not written by us (peft's own save): nothing to pair
        return config, data, header, None
    try:
        saved = json.loads(saved)
    except json.JSONDecodeError as err:
        raise ValueError(f"{weights_path}: its {PAIRING_KEY} metadata is not valid JSON ({err}): the file "
                         "is damaged; use another copy") from None
    # A field the weights do not record is not compared.
    differ = [key for key in _PAIRED_FIELDS
              if not isinstance(saved, dict) or (key in saved and config.get(key) != saved[key])]
    if not differ:
        return config, data, header, None
    return config, data, header, (
        f"{config_path} is not the config {WEIGHTS_NAME} was saved with (" +
        ", ".join(f"{key}={config.get(key)!r} in the config, "
                  f"{saved.get(key) if isinstance(saved, dict) else None!r} with the weights" for key in differ) +
        "): the folder was being written while it was read (load it again), or it was edited since "
        "(save the adapter again)")


_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _read_peft(model: nn.Module, folder: Path, residual_base: bool):
    from safetensors import SafetensorError
    from safetensors.torch import load as safetensors_load

    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder; a PEFT adapter is a folder holding {CONFIG_NAME} and "
                         f"{WEIGHTS_NAME}")
    weights_path = folder / WEIGHTS_NAME
    # Both files are read once, into memory: every check below and the tensors see the same bytes.
    config_json, data, header, disagreement = _read_peft_pair(folder)
    config = LoraConfig.from_peft_fields(config_json, str(folder / CONFIG_NAME), loading=True,
                                         residual_base=residual_base)
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape, dtype = tuple(entry.get("shape", ())), entry.get("dtype")
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
        r = config.rank_of(module)
        if len(pair["A"]) != 2 or len(pair["B"]) != 2 or pair["A"][0] != r or pair["B"][1] != r:
            raise ValueError(f"{weights_path}: {module} has lora_A {list(pair['A'])} and lora_B "
                             f"{list(pair['B'])}, which is not rank r={r} from {CONFIG_NAME}")
    adapter = _Adapter(config, {module: (pair["A"], pair["B"]) for module, pair in shapes.items()})
    fit_targets = _fit(model, adapter, str(folder))
    try:
        stored = safetensors_load(data)
    except SafetensorError as err:
        raise ValueError(f"{weights_path} is not a valid safetensors file: {err}") from None
    expected = (header.get("__metadata__") or {}).get(CHECKSUM_KEY)
    if expected is not None and _sha256(stored) != expected:
        raise ValueError(f"{weights_path}: the tensors differ from when the file was written (checksum mismatch): "
                         "the file is damaged; use another copy")
    tensors = {module: (stored[f"{PEFT_PREFIX}{module}.lora_A.weight"], stored[f"{PEFT_PREFIX}{module}.lora_B.weight"])
               for module in shapes}
    _check_finite(weights_path, tensors)
    if disagreement is not None:
        raise ValueError(disagreement)
    return adapter, fit_targets, tensors


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
    config = LoraConfig(r=_uniform(modules, "rank", lambda m: m.r, "the Hesper format has one rank"),
                        lora_alpha=_uniform(modules, "lora_alpha", lambda m: m.lora_alpha,
                                            "the Hesper format has one alpha"),
                        target_modules=HESPER_TARGETS)
    _check_scaling(modules)
    if any(m.use_rslora for m in modules.values()):
        raise ValueError("the Hesper format scales adapters by lora_alpha / r; these use rsLoRA's lora_alpha / sqrt(r)")
    if float(np.float32(config.lora_alpha)) != config.lora_alpha:
        raise ValueError(f"lora_alpha={config.lora_alpha!r} is not exactly a float32, which the Hesper header "
                         "stores; use a value float32 holds exactly (e.g. an integer)")
    parts = []
    for (q_name, _), (v_name, _) in pairs:
        for m in (modules[q_name], modules[v_name]):
            parts.append(m.lora_A.detach().float().numpy().astype("<f4").tobytes())
            parts.append(m.lora_B.detach().float().numpy().astype("<f4").tobytes())
    data = b"".join(parts)
    checked = _HESPER_HEADER.pack(HESPER_MAGIC, HESPER_VERSION, config.r, config.lora_alpha, len(pairs), 0)
    checksum = zlib.crc32(data, zlib.crc32(checked[:_HESPER_CHECKED]))
    header = _HESPER_HEADER.pack(HESPER_MAGIC, HESPER_VERSION, config.r, config.lora_alpha, len(pairs), checksum)
    path.parent.mkdir(parents=True, exist_ok=True)  # as a PEFT save creates its folder's parents
    write_atomic(path, header + data)


def _read_hesper(model: nn.Module, path: Path):
    if not path.is_file():
        raise ValueError(f"{path} is not a file; a Hesper adapter is one binary file")
    with open(path, "rb") as f:
        header = f.read(_HESPER_HEADER.size)
        if len(header) < _HESPER_HEADER.size:
            raise ValueError(f"{path}: {len(header)} bytes, shorter than the {_HESPER_HEADER.size}-byte Hesper header")
        magic, version, r, alpha, num_layers, checksum = _HESPER_HEADER.unpack(header)
        if magic != HESPER_MAGIC:
            raise ValueError(f"{path}: magic is 0x{magic:08X}, not Hesper's 0x{HESPER_MAGIC:08X}: not a Hesper adapter")
        if version != HESPER_VERSION:
            raise ValueError(f"{path}: Hesper format version {version}; only version {HESPER_VERSION} is supported")
        if r < 1:
            raise ValueError(f"{path}: rank is {r}; it must be at least 1")
        if not math.isfinite(alpha):
            raise ValueError(f"{path}: alpha is {alpha}, not a finite number")
        config = _file_config(path, r=r, lora_alpha=alpha, target_modules=HESPER_TARGETS)
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
        adapter = _Adapter(config, shapes)
        targets = _fit(model, adapter, str(path))
        data = f.read()
    # 0 is what Hesper writes: no checksum to check.
    if checksum != 0 and zlib.crc32(data, zlib.crc32(header[:_HESPER_CHECKED])) != checksum:
        raise ValueError(f"{path}: the contents differ from when the file was written (CRC-32 mismatch): the file is "
                         "damaged; use another copy")
    values = torch.from_numpy(np.frombuffer(bytearray(data), dtype="<f4").astype(np.float32, copy=False))
    tensors, offset = {}, 0
    for name, (a_shape, b_shape) in shapes.items():
        a_size, b_size = math.prod(a_shape), math.prod(b_shape)
        tensors[name] = (values[offset:offset + a_size].view(a_shape),
                         values[offset + a_size:offset + a_size + b_size].view(b_shape))
        offset += a_size + b_size
    _check_finite(path, tensors)
    return adapter, targets, tensors


def _detect_format(path: Path) -> str:
    if path.is_dir():
        return "peft"
    with open(path, "rb") as f:
        head = f.read(4)
    if len(head) == 4 and struct.unpack("<I", head)[0] == HESPER_MAGIC:
        return "hesper"
    raise ValueError(f"{path} is neither a PEFT adapter folder (pass the folder holding {CONFIG_NAME}) nor a "
                     f"Hesper adapter file (magic 0x{HESPER_MAGIC:08X})")
