"""Hugging Face BitNet models with LoRA adapters on their projections: checkpoints in their three
weight flavours (``load_bitnet``), the modules adapters go on (``lora_targets``), the ``LoRALinear``
layers put in their place (``add_lora_layers``, which ``torch_wgpu_lora.apply_lora`` calls before
giving the model PEFT's model API), and the straight-through backward of packed layers.

>>> # model = load_bitnet("path/to/bitnet-b1.58-2B-4T-bf16")
>>> # add_lora_layers(model, r=8, target_modules=("q_proj", "v_proj"))   # torch_wgpu_lora.apply_lora: the same,
>>> # optimizer = torch.optim.AdamW(lora_parameters(model))              # and PEFT's model API

Gradients through packed layers. transformers' packed ``BitLinear`` (checkpoints whose
``quantization_config`` says ``linear_class "bitlinear"``) casts its activations to
int8 inside its forward, which cuts autograd's path to its input: an adapter in layer 0
would get almost none of the gradient that flows back through the later layers'
projections. ``add_lora_layers`` therefore gives every packed ``BitLinear`` of the model
(wrapped or not) the straight-through backward that ``AutoBitLinear`` already has:
activation quantisation counts as the identity, so with ``y ≈ x·Wᵀ / weight_scale``
(``BitLinear`` divides by its scale; ``AutoBitLinear`` multiplies by its own)

    dx = (dy / weight_scale) · W_ternary.

The forward is transformers' own, op for op, except where the ternary weight comes from:
``unpack_ternary`` writes the same values into a buffer each thread reuses, where
transformers' ``unpack_weights`` allocates about three times the unpacked weight afresh on
every call (on a CPU, first-touch page faults that cost more than the unpacking itself).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import sys
import threading
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ALL_LINEAR, LoraConfig
from ..modules import LoRALinear, LoRASum
from .gguf import is_gguf_path, load_gguf_bitnet, load_gguf_tokenizer

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# transformers' from_pretrained swaps process-wide state while it builds a model (torch's default
# dtype; PreTrainedModel.tie_weights, replaced by a no-op and put back): two at once in two threads
# can leave the no-op in place for good, and every model loaded after it untied. One at a time.
_FROM_PRETRAINED = threading.Lock()
_TRANSFORMERS_BITNET = "transformers.integrations.bitnet"


def is_linear_like(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer in shape: integer ``in_features`` and ``out_features``."""
    return all(isinstance(getattr(module, attr, None), int) for attr in ("in_features", "out_features"))


def layer_index(name: str) -> int | None:
    """The decoder layer a qualified module name lies in (``model.layers.3.mlp`` → 3), else None."""
    match = _LAYER_INDEX.search(name + ".")
    return int(match.group(1)) if match else None


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The norm output each projection reads: its quantisation point (q, k and v share one, gate and up another).
PROJECTION_SITES = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp",
                    "up_proj": "mlp", "down_proj": "down"}


def base_layer(module: nn.Module) -> nn.Module:
    """The projection under a LoRA wrapper (ours or PEFT's), else the module itself."""
    return getattr(module, "base_layer", module)


def projection(layer: nn.Module, name: str) -> nn.Module:
    """A decoder layer's projection ``name`` (its LoRA wrapper, if any)."""
    parent = layer.self_attn if name in PROJECTIONS[:4] else layer.mlp
    return getattr(parent, name)


def projection_modules(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """(layer, name, base projection module) of every projection of a BitNet model."""
    return [(index, name, base_layer(projection(layer, name)))
            for index, layer in enumerate(model.model.layers) for name in PROJECTIONS]


UNPACK_SHAPES = 8  # unpacking buffers a thread keeps: BitNet has 4 packed shapes (q/o, k/v, gate/up, down)


class _UnpackBuffers(threading.local):
    """This thread's ``unpack_ternary`` buffers, (values, one bit field) by (packed shape, dtype,
    device), the ``UNPACK_SHAPES`` most recently used."""

    def __init__(self) -> None:
        self.by_key: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()


_UNPACK_BUFFERS = _UnpackBuffers()


def unpack_ternary(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' ``unpack_weights(packed, dtype)``: a packed ``BitLinear`` weight [rows / 4, ...]
    (four 2-bit codes a byte, bit field i holding rows i·rows/4 onwards) as ternary values
    [rows, ...] in ``dtype``, written into a buffer that this thread reuses for every weight of
    that shape: the next call with that shape on this thread overwrites the result, so use it at
    once (the packed layers' forward and backward do). A thread keeps the buffers of its
    ``UNPACK_SHAPES`` most recent shapes and dtypes (BitNet-2B's four in float32: 174 MB).
    Inside ``torch.compile``, and for a layer without a dtype, it is transformers' own function.

    >>> unpack_ternary(torch.tensor([[0b10_01_00_10]], dtype=torch.uint8), torch.float32).flatten().tolist()
    [1.0, -1.0, 0.0, 1.0]
    """
    if torch.compiler.is_compiling() or dtype is None:
        return sys.modules[_TRANSFORMERS_BITNET].unpack_weights(packed, dtype=dtype)
    key, kept = (tuple(packed.shape), dtype, packed.device), _UNPACK_BUFFERS.by_key
    if key in kept:
        kept.move_to_end(key)
    else:
        kept[key] = (torch.empty((4 * packed.shape[0], *packed.shape[1:]), dtype=dtype, device=packed.device),
                     torch.empty_like(packed))
        if len(kept) > UNPACK_SHAPES:
            kept.popitem(last=False)
    values, field = kept[key]
    for i, rows in enumerate(values.split(packed.shape[0])):
        torch.bitwise_right_shift(packed, 2 * i, out=field)
        rows.copy_(field.bitwise_and_(3)).sub_(1)  # slice by slice: each still in cache for its sub
    return values


def _bitlinear_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``BitLinear.forward``, op for op, with its weight from ``unpack_ternary``."""
    if layer.rms_norm is not None:
        x = layer.rms_norm(x)
    x_quant, x_scale = layer.activation_quant(x)
    y = F.linear(x_quant.to(layer.dtype), unpack_ternary(layer.weight, layer.dtype))
    y = layer.post_quant_process(y, layer.weight_scale, x_scale)
    if layer.bias is not None:
        y += layer.bias.view(1, -1).expand_as(y)
    return y


class _BitLinearSTE(torch.autograd.Function):
    """transformers' ``BitLinear.forward`` with the straight-through backward
    dx = (dy / weight_scale) · W_ternary (through the layer's optional RMSNorm)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        ctx.layer = layer
        ctx.x_dtype = x.dtype
        if layer.rms_norm is not None:
            ctx.save_for_backward(x)
        return _bitlinear_forward(layer, x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        layer = ctx.layer
        weight = unpack_ternary(layer.weight, layer.dtype)
        dx = (dy / layer.weight_scale).to(weight.dtype) @ weight
        if layer.rms_norm is not None:  # BitLinear normalises before quantising: chain through it
            (x,) = ctx.saved_tensors
            with torch.enable_grad():
                x = x.detach().requires_grad_(True)
                (dx,) = torch.autograd.grad(layer.rms_norm(x), x, dx)
        return dx.to(ctx.x_dtype), None


def _bitlinear_class() -> type | None:
    """transformers' packed ``BitLinear`` if transformers' BitNet code is loaded (a model
    that holds one has loaded it), else None; avoids importing transformers here."""
    module = sys.modules.get(_TRANSFORMERS_BITNET)
    return None if module is None else module.BitLinear


@functools.cache
def _ste_bitlinear_class() -> type:
    BitLinear = _bitlinear_class()

    class STEBitLinear(BitLinear):
        """transformers' packed ``BitLinear`` with a straight-through backward (see
        ``torch_wgpu_lora.integrations.bitnet``); forward, buffers and state dict unchanged."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return _BitLinearSTE.apply(input, self)

    return STEBitLinear


def use_ste_backward(model: nn.Module) -> int:
    """Give every packed ``BitLinear`` in ``model`` the straight-through backward, in place.

    The layer keeps its forward (transformers' own, bit for bit), buffers and state-dict
    keys; only its class changes, to a subclass whose backward is
    dx = (dy / weight_scale) · W_ternary. ``add_lora_layers`` calls this. Returns how many
    layers were changed (already changed ones are left alone).

    >>> # use_ste_backward(load_bitnet(packed_folder))  # -> 7 × num_hidden_layers
    """
    BitLinear = _bitlinear_class()
    if BitLinear is None:
        return 0
    ste_class = _ste_bitlinear_class()
    changed = 0
    for module in model.modules():
        if type(module) is BitLinear:
            module.__class__ = ste_class
            changed += 1
    return changed


def lora_targets(model: nn.Module, config: LoraConfig) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every linear module of ``model`` that ``config`` selects, in model
    order, by PEFT's rules (``LoraConfig.selects``); ``"all-linear"`` leaves out the output layer
    (``get_output_embeddings``), as PEFT does. ValueError when a target name, or the whole selection,
    matches nothing.

    >>> # [name for name, _ in lora_targets(model, LoraConfig(target_modules="all-linear"))][:2]
    >>> # ['model.layers.0.self_attn.q_proj', 'model.layers.0.self_attn.k_proj']
    """
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = [(n, m) for n, m in model.named_modules() if n and is_linear_like(m)
              and not (config.target_modules == ALL_LINEAR and m is output)]
    names = sorted({n.rsplit(".", 1)[-1] for n, _ in linear})
    if isinstance(config.target_modules, tuple):
        unknown = [t for t in config.target_modules if not any(n == t or n.endswith(f".{t}") for n, _ in linear)]
        if unknown:
            raise ValueError(f"target_modules {unknown} match no module; linear modules in this model: {names}")
    selected = [(n, m) for n, m in linear if config.selects(n)]
    if not selected:
        raise ValueError(f"target_modules={config.target_modules!r} (with exclude_modules={config.exclude_modules!r}, "
                         f"layers_to_transform={config.layers_to_transform!r}) selects no linear module of this model; "
                         f"its linear modules: {names}")
    return selected


def add_lora_layers(model: nn.Module, config: Any = None, **fields: Any) -> nn.Module:
    """Replace every module the config selects with a ``LoRALinear`` wrapping it.

    ``config`` (default ``LoraConfig()``; a ``peft.LoraConfig`` is read with ``LoraConfig.from_peft``,
    which refuses by name what this package does not implement) with ``fields`` replacing its values:
    ``add_lora_layers(model, r=8, lora_alpha=16)`` and ``add_lora_layers(model, LoraConfig(r=8, lora_alpha=16))``
    are the same. Modules are selected as PEFT selects them (``lora_targets``), each with its
    rank and alpha from ``rank_pattern`` / ``alpha_pattern``. The model keeps the config it was
    given as ``model.lora_config``. (``torch_wgpu_lora.apply_lora``, ``integrations.peft``'s, calls
    this and then gives the model PEFT's model API: it is the one to use.)

    Every other parameter is frozen. With ``init="hesper"``, the adapter of target t (the position
    in ``target_modules`` of the name it matched; with "all-linear" or a regex, of its name among
    the selected modules' names in model order) in layer i is seeded ``seed + T*i + t`` (T targets):
    for the default Q/V targets, ``seed + 2i`` and ``seed + 2i + 1`` as in Hesper.
    Every packed ``BitLinear`` of the model, target or not, gets the straight-through
    backward (``use_ste_backward``). Returns ``model`` (changed in place). Unknown
    targets or invalid settings raise ValueError before any module is replaced or patched.

    >>> # add_lora_layers(load_bitnet(folder), r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"))
    """
    if config is not None and not isinstance(config, LoraConfig):
        config = LoraConfig.from_peft(config)
    config = (config or LoraConfig()).updated(**fields)
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("this model already has LoRA adapters (apply_lora was called before)")
    selected = lora_targets(model, config)
    if isinstance(config.target_modules, tuple):
        kinds = list(config.target_modules)
        kind = {n: next(t for t in kinds if n == t or n.endswith(f".{t}")) for n, _ in selected}
    else:
        kind = {n: n.rsplit(".", 1)[-1] for n, _ in selected}
        kinds = list(dict.fromkeys(kind.values()))
    # Build every adapter before changing the model, so bad arguments leave it untouched.
    wrappers = [
        (name, LoRALinear(module, r=config.rank_of(name), lora_alpha=config.alpha_of(name),
                          lora_dropout=config.lora_dropout, init=config.init, backend=config.backend,
                          use_rslora=config.use_rslora,
                          seed=(config.seed + len(kinds) * (layer_index(name) or 0) + kinds.index(kind[name])) % 2 ** 64))
        for name, module in selected
    ]
    model.requires_grad_(False)
    use_ste_backward(model)
    for name, wrapped in wrappers:
        model.set_submodule(name, wrapped)
    model.lora_config = config
    return model


def lora_modules(model: nn.Module) -> "OrderedDict[str, LoRALinear]":
    """The model's LoRALinear modules by qualified name, in model order: one adapter a module. A model
    running several adapters at once on a module (``LoRASum``, from ``set_adapter`` with a list) is
    refused, naming the module: what reads one adapter a module (saving one adapter, training with
    ``twl.train``, the engine, ...) would take the wrong one."""
    for name, m in model.named_modules():
        if isinstance(m, LoRASum):
            raise ValueError(f"{name} runs several adapters at once ({', '.join(m.names)}: set_adapter was given a "
                             "list); this needs one adapter a module: set_adapter(name) first")
    return OrderedDict((n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear))


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every adapter parameter (lora_A, lora_B of each LoRALinear), in model order."""
    return [p for m in lora_modules(model).values() for p in (m.lora_A, m.lora_B)]


def lora_state_dict(model: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """Adapter tensors keyed like ``model.layers.0.self_attn.q_proj.lora_A`` (detached)."""
    out = OrderedDict()
    for name, m in lora_modules(model).items():
        out[f"{name}.lora_A"] = m.lora_A.detach()
        out[f"{name}.lora_B"] = m.lora_B.detach()
    return out


def set_backend(model: nn.Module, backend: str) -> nn.Module:
    """Switch every adapter of ``model`` to ``backend`` ("wgpu" or "torch")."""
    if getattr(model, "lora_config", None) is not None:
        model.lora_config = model.lora_config.updated(backend=backend)
    for m in lora_modules(model).values():
        m.backend = backend
    return model


@contextmanager
def swapped_dropout(modules: dict[str, nn.Module], dropouts: dict[str, nn.Module]) -> Iterator[None]:
    """The adapters ``modules`` (by name) with ``lora_dropout`` replaced by ``dropouts[name]`` for
    the duration, then restored.

    >>> # with swapped_dropout(lora_modules(model), {n: nn.Dropout(0.1) for n in lora_modules(model)}): ...
    """
    saved = {name: modules[name].lora_dropout for name in dropouts}
    try:
        for name, dropout in dropouts.items():
            modules[name].lora_dropout = dropout
        yield
    finally:
        for name, dropout in saved.items():
            modules[name].lora_dropout = dropout


def load_bitnet(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a ``BitNetForCausalLM`` checkpoint folder, or a GGUF file, from local disk (never the Hub).

    A path ending in ``.gguf`` is read by ``integrations.gguf.load_gguf_bitnet`` (llama.cpp's
    TQ1_0 / TQ2_0 and bitnet.cpp's i2_s files, as the packed flavour below). In a folder, all three
    checkpoint flavours load; transformers picks the layer class from ``config.json``'s
    ``quantization_config``:

    * none: dense ``nn.Linear`` projections;
    * ``linear_class "autobitlinear"``, ``quantization_mode "online"``: ``AutoBitLinear``
      ternarising full-precision weights on the fly (microsoft/bitnet-b1.58-2B-4T-bf16);
    * ``quantization_mode "offline"``: packed 2-bit weights with ``weight_scale``, as
      ``BitLinear`` (divides by the scale) for ``linear_class "bitlinear"`` or unpacked
      into ``AutoBitLinear`` (multiplies by it) for ``"autobitlinear"``
      (microsoft/bitnet-b1.58-2B-4T).

    Threads may call it at once: the loads take turns (transformers' ``from_pretrained`` is not
    thread-safe). Quantised checkpoints need ``accelerate`` installed. The real models, once
    downloaded by the user (e.g. ``hf download microsoft/bitnet-b1.58-2B-4T-bf16
    --local-dir bitnet-bf16``; the packed one likewise), load the same way::

        model = load_bitnet("bitnet-bf16", dtype=torch.bfloat16)   # ~5 GB of weights
        model = load_bitnet("bitnet-packed", dtype=torch.float32)  # unpacked to ~10 GB

    >>> import tempfile
    >>> from torch_wgpu_lora.integrations.tiny import build_tiny_bitnet
    >>> model = load_bitnet(build_tiny_bitnet(tempfile.mkdtemp(), flavour="dense"))
    >>> type(model.model.layers[0].self_attn.q_proj).__name__
    'Linear'
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}")
    if is_gguf_path(path):
        return load_gguf_bitnet(path, dtype)
    folder = Path(path)
    if not folder.exists():
        raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ValueError(f"{str(folder)!r} is not a folder; load_bitnet takes a checkpoint folder "
                         "holding config.json and *.safetensors")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json; is it a Hugging Face checkpoint folder?")
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{str(config_file)!r} is not a JSON object: {e}") from e
    if model_type != "bitnet":
        raise ValueError(f"{str(folder)!r} holds a {model_type!r} model; load_bitnet loads model_type 'bitnet'")
    _check_weight_files(folder)
    from transformers import BitNetForCausalLM

    # Mismatched sizes are reported below with the other disagreements rather than raised by transformers.
    with _FROM_PRETRAINED:
        model, info = BitNetForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True,
                                                        use_safetensors=True, output_loading_info=True,
                                                        ignore_mismatched_sizes=True)
    _check_tied(folder, model)  # before the missing lm_head.weight it would otherwise be reported as
    _check_loading_info(folder, info, _shapes_unlike_config(model))
    return model


def _check_tied(folder: Path, model: nn.Module) -> None:
    """Refuse a model whose lm_head transformers left untied from the embeddings although config.json
    ties them, naming the cause: a ``from_pretrained`` that ran at the same time in another thread,
    outside ``load_bitnet``, left transformers' loader's no-op in place of ``tie_weights``."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is embeddings.weight:
        return
    tie = type(model).tie_weights.__qualname__
    cause = "transformers did not tie them" if tie == "PreTrainedModel.tie_weights" else (
        f"transformers' tie_weights is {tie!r}, the no-op its from_pretrained puts in place while it builds a "
        "model: a from_pretrained that ran at the same time in another thread, outside load_bitnet (which loads "
        "one model at a time), left it there, and no model this process loads is tied any more. Load models "
        "from one thread at a time, in a new process")
    raise ValueError(f"{str(folder)!r}: lm_head is not tied to the embeddings, as config.json's tie_word_embeddings "
                     f"asks ({cause})")


def _shapes_unlike_config(model: nn.Module) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(name, loaded shape, shape by config) of each parameter whose shape is not the one the model's
    config gives it (integer weights: ternary codes packed four rows a byte, as transformers packs
    them). transformers reports such tensors itself, except where its quantiser loads them
    (transformers 5.17, packed AutoBitLinear: the checkpoint's tensors kept as they are, whatever
    config.json says)."""
    from transformers.integrations.bitnet import VALUES_PER_ITEM

    with torch.device("meta"):
        described = dict(type(model)(copy.deepcopy(model.config)).named_parameters())
    unlike = []
    for name, p in model.named_parameters():
        if name not in described:
            continue
        wanted = tuple(described[name].shape)
        if not p.is_floating_point() and wanted:
            wanted = (-(-wanted[0] // VALUES_PER_ITEM), *wanted[1:])
        if tuple(p.shape) != wanted:
            unlike.append((name, tuple(p.shape), wanted))
    return unlike


def _check_weight_files(folder: Path) -> None:
    """Refuse a folder without safetensors weights, or with a damaged (e.g. truncated) weights file."""
    from safetensors import SafetensorError, safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in sorted(folder.iterdir()) if p.suffix in (".bin", ".pt", ".pth")]
        found = f" (it holds {', '.join(pickles)}: pickles, which can run arbitrary code when loaded)" \
            if pickles else ""
        raise ValueError(f"{str(folder)!r} has no *.safetensors weights{found}; torch_wgpu_lora reads safetensors "
                         "only. Convert them where you trust the files: "
                         "BitNetForCausalLM.from_pretrained(folder).save_pretrained(out) writes safetensors")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except SafetensorError as err:
            raise ValueError(f"{file} is not a complete safetensors file ({err}): truncated or damaged; "
                             "download it again") from None


def _check_loading_info(folder: Path, info: dict[str, list], unlike: list[tuple[str, Any, Any]]) -> None:
    """Refuse weights that do not fill the model config.json describes, exactly: transformers'
    loading report, and ``unlike`` (tensors loaded in a shape config.json does not give them)."""
    missing, unexpected = (sorted(info[k]) for k in ("missing_keys", "unexpected_keys"))
    mismatched = sorted([*info["mismatched_keys"], *unlike])  # disjoint: transformers reinitialises what it reports
    if mismatched:
        key, stored, wanted = mismatched[0]
        raise ValueError(f"{str(folder)!r}: the weights do not match config.json: {key} is {list(stored)} in the "
                         f"weights but {list(wanted)} by config.json ({len(mismatched)} tensors differ); is "
                         "config.json from another model size?")
    if missing:
        raise ValueError(f"{str(folder)!r}: config.json describes tensors the weights lack, e.g. {missing[0]} "
                         f"({len(missing)} missing); is config.json from another model size?")
    if unexpected:
        raise ValueError(f"{str(folder)!r}: the weights hold tensors config.json does not describe, e.g. "
                         f"{unexpected[0]} ({len(unexpected)} extra); is config.json from another model size?")


def load_model_and_tokenizer(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any]:
    """``load_bitnet(path, dtype)`` and the tokenizer stored beside it (local files only), or, for a
    ``.gguf`` file, the tokenizer the file describes.

    >>> # model, tokenizer = load_model_and_tokenizer("bitnet-bf16")
    """
    from transformers import AutoTokenizer

    if is_gguf_path(path):
        tokenizer = load_gguf_tokenizer(path)  # first: a file without one fails before the model loads
        return load_bitnet(path, dtype=dtype), tokenizer
    model = load_bitnet(path, dtype=dtype)  # checks the folder and that it holds a BitNet model
    folder = Path(path)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise FileNotFoundError(f"{str(folder)!r} has no tokenizer (tokenizer.json or tokenizer_config.json); "
                                "download the checkpoint's tokenizer files into the same folder")
    return model, AutoTokenizer.from_pretrained(folder, local_files_only=True)
