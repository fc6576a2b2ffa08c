"""PEFT's ways with torch_wgpu_lora's adapters: PEFT's model API, and PEFT models converted.

>>> # model = apply_lora(load_bitnet(folder), peft.LoraConfig(r=8, target_modules="all-linear"))
>>> # model.print_trainable_parameters()
>>> # with model.disable_adapter(): base_logits = model(ids).logits
>>> # model.load_adapter("other/adapter", adapter_name="other"); model.set_adapter("other")
>>> # model.save_pretrained("out")              # PEFT's layout, as transformers' Trainer.save_model calls it
>>> # model(**batch, adapter_names=["default", "other", "__base__"])  # an adapter a row, as PEFT's mixed batches
>>> # model.set_adapter(["default", "other"])  # both at once, their effects added
>>> # merged = model.merge_and_unload()         # dense flavour only: a plain BitNetForCausalLM
>>> # ours = from_peft(peft_model)             # a PeftModel's LoRA layers as ours, sharing its Parameters

**The model API.** ``apply_lora`` and ``load_adapter``, which the package exports, put adapters on
a transformers model (``integrations.bitnet.add_lora_layers``, from a config;
``integrations.adapter_files.load_adapter_file``, from a file) and give the model PEFT's
``PeftModel`` methods (``LoraModelMixin``): ``print_trainable_parameters``,
``get_nb_trainable_parameters``, the ``disable_adapter()`` context, named adapters
(``add_adapter``, ``load_adapter``, ``set_adapter``, ``delete_adapter``, ``active_adapter``) and
``save_pretrained``, which writes the adapters in PEFT's layout (the ``"default"`` adapter in the
folder, others in sub-folders named after them, as PEFT does). transformers' ``Trainer.save_model``
and TRL's trainers call ``save_pretrained``, so their outputs are adapters
``PeftModel.from_pretrained`` and ``load_adapter`` read. The model's class becomes a subclass of
its own (``BitNetForCausalLM`` becomes ``BitNetForCausalLMWithLoRA``); forward, state dict and
everything else are unchanged.

Named adapters: the active adapter's ``LoRALinear`` modules are in the model, the others are
kept aside and swapped in by ``set_adapter``. Parameters, optimizers and ``BitNetEngine``
therefore see the active adapter alone (the engine re-lays out its adapters when they change).

Several adapters at once, as PEFT runs them. ``set_adapter([names])`` makes several adapters
active, their effects added (a module that more than one of them adapts holds a ``LoRASum``;
what needs one adapter a module, such as ``twl.train``, ``save_adapter`` or ``BitNetEngine``,
refuses it, naming the module). ``adapter_names=[...]`` in the model's call or in ``generate``
gives each row of the batch its own adapter (``"__base__"``: none), whichever are active: for
inference, refused in training mode, with merged adapters and for unknown names, as in PEFT.
``BitNetEngine`` takes ``adapter_names`` too, every row in one pass (``EngineAdapters.refresh(serve_rows=True)``).

Merging. ``merge_adapter`` / ``unmerge_adapter``, ``merge_and_unload`` and ``unload`` as PEFT's,
and ``get_base_model`` (this model, adapters in place, as ``PeftModel.get_base_model()``). A
merge is exact (up to float rounding) on the dense flavour only: on the online and packed
flavours W + scaling·B·A is no longer ternary, and quantising it again would change the model,
so the merge is refused, saying so and naming the ways to serve the adapter beside the base
(PEFT's layout with transformers or peft, the LoRA GGUF with llama.cpp).

**PEFT models.** ``from_peft`` turns a ``PeftModel`` (or a base model ``get_peft_model`` wrapped)
into a transformers model holding our adapters that shares every tensor with it: the LoRA layers
of the active adapter become ``LoRALinear`` modules holding PEFT's own ``lora_A`` / ``lora_B``
Parameters. Training it trains the PEFT model's adapter. Anything this package does not run
(DoRA, biases, embeddings, ``modules_to_save``, several active adapters, merged layers) is
refused, naming the module.
"""

from __future__ import annotations

import copy
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..config import LoraConfig
from ..modules import LoRALinear, LoRASum, PerRowLoRA
from . import adapter_files
from . import bitnet

__all__ = ["BASE_ROW", "DEFAULT_ADAPTER", "LoraModelMixin", "apply_lora", "from_peft", "load_adapter", "peft_layers"]

DEFAULT_ADAPTER = "default"  # PEFT's name for the first adapter, saved in the folder itself
BASE_ROW = "__base__"  # PEFT's name, in adapter_names, for a row that runs the base model alone


class LoraModelMixin:
    """PEFT's ``PeftModel`` methods on a transformers model holding torch_wgpu_lora's adapters.

    Models get it from ``apply_lora`` / ``load_adapter`` (this module's); the methods keep PEFT's
    names and arguments. Where transformers' own PEFT methods take other arguments
    (``add_adapter(adapter_config, adapter_name)``, ``delete_adapter([names])``) those forms work too.
    """

    _lora_adapters: dict[str, dict[str, LoRALinear]]
    _lora_configs: dict[str, LoraConfig | None]
    _active_adapters: list[str]

    @property
    def active_adapter(self) -> str | list[str] | None:
        """The name of the adapter in use; the list of names where ``set_adapter`` was given several
        (as PEFT's ``LoraModel`` keeps it); None when every adapter was deleted."""
        active = self._active_adapters
        return None if not active else active[0] if len(active) == 1 else list(active)

    @property
    def active_adapters(self) -> list[str]:
        """The names of the adapters in use, always a list (PEFT's ``active_adapters``)."""
        return list(self._active_adapters)

    @property
    def adapter_names(self) -> list[str]:
        """Every adapter's name, in the order they were added."""
        return list(self._lora_adapters)

    def named_adapters(self) -> dict[str, dict[str, LoRALinear]]:
        """Every adapter, active or not, by name: {adapter name: {module name: its ``LoRALinear``}}."""
        return {name: dict(modules) for name, modules in self._lora_adapters.items()}

    @property
    def _hf_peft_config_loaded(self) -> bool:
        """transformers' mark of a model holding trainable adapters (its ``PeftAdapterMixin`` sets it when
        it attaches PEFT adapters). Its Trainer trains a quantised base (the packed flavours) only so, as
        adapters on a frozen base, and refuses it otherwise ("purely quantized models"); with gradient
        checkpointing it keeps the inputs' gradients flowing to the adapters."""
        return bool(self._lora_adapters)

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """(trainable, all) parameter counts, as PEFT counts them."""
        params = list(self.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)

    def print_trainable_parameters(self) -> None:
        """Print the counts as PEFT does: ``trainable params: ... || all params: ... || trainable%: ...``."""
        trainable, total = self.get_nb_trainable_parameters()
        print(f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {100 * trainable / total:.4f}")

    @contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Within the context the model computes what its base model computes (the adapters add nothing)."""
        modules = [m for m in self.modules() if isinstance(m, LoRALinear)]  # several a module after set_adapter([...])
        saved = [m.disabled for m in modules]
        try:
            for m in modules:
                m.disabled = True
            yield
        finally:
            for m, was in zip(modules, saved):
                m.disabled = was

    def disable_adapters(self) -> None:
        """transformers' ``disable_adapters``: the model computes what its base model computes until
        ``enable_adapters`` (``disable_adapter`` is the same as a context)."""
        for m in self.modules():
            if isinstance(m, LoRALinear):
                m.disabled = True

    def enable_adapters(self) -> None:
        """transformers' ``enable_adapters``: the adapters in use add their effect again."""
        for m in self.modules():
            if isinstance(m, LoRALinear):
                m.disabled = False

    def get_adapter_state_dict(self, adapter_name: str | None = None, state_dict: Any = None) -> dict:
        """transformers' ``get_adapter_state_dict`` is not offered: a ValueError naming the ways to the
        adapter's tensors in PEFT's layout."""
        raise ValueError("get_adapter_state_dict is not offered for torch_wgpu_lora adapters: save_pretrained(folder) "
                         "writes them in PEFT's layout (adapter_model.safetensors), and lora_modules(model) gives the "
                         "LoRALinear layers themselves")

    def add_adapter(self, adapter_name: Any, peft_config: Any = None) -> None:
        """Add a new adapter ``adapter_name`` made from ``peft_config`` (ours or peft's LoraConfig);
        it is not made active (``set_adapter``). transformers' order, ``add_adapter(config, name)``, works too."""
        if not isinstance(adapter_name, str):  # transformers' PeftAdapterMixin.add_adapter(adapter_config, adapter_name)
            adapter_name, peft_config = peft_config or DEFAULT_ADAPTER, adapter_name
        self._check_new_name(adapter_name)
        if peft_config is None:
            raise TypeError("add_adapter needs a LoraConfig (torch_wgpu_lora's or peft's)")
        with self._bare():
            bitnet.add_lora_layers(self, peft_config)
            self._take_new(adapter_name)

    def load_adapter(self, model_id: str | os.PathLike, adapter_name: str = DEFAULT_ADAPTER, *,
                     residual_base: bool = False) -> None:
        """Load the adapter at ``model_id`` (a PEFT folder or a Hesper file) as ``adapter_name``; it is
        not made active (``set_adapter``). ``residual_base``: as ``adapter_files.load_adapter_file``."""
        self._check_new_name(adapter_name)
        with self._bare():
            adapter_files.load_adapter_file(self, model_id, residual_base=residual_base)
            self._take_new(adapter_name)

    def set_adapter(self, adapter_name: str | list[str]) -> None:
        """Make ``adapter_name`` the adapter in use, or, given a list of names, run those adapters
        together, their effects added, as PEFT's ``LoraModel.set_adapter`` and transformers'
        ``set_adapter`` do (a module that several of them adapt becomes a ``LoRASum``; what needs one
        adapter a module, such as ``twl.train`` or ``BitNetEngine``, refuses that, naming it).
        ``lora_config`` is then the first one's."""
        names = [adapter_name] if isinstance(adapter_name, str) else adapter_name
        if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
            raise TypeError(f"set_adapter takes an adapter name or a non-empty list of names, got {adapter_name!r}")
        for name in names:
            if name not in self._lora_adapters:
                raise ValueError(f"no adapter named {name!r}; the adapters are {self.adapter_names}")
        if len(set(names)) != len(names):
            raise ValueError(f"set_adapter was given an adapter twice: {list(names)}")
        if list(names) == self._active_adapters:
            return
        self._check_unmerged("set_adapter")
        self._swap_out()
        self._active_adapters = list(names)
        self._swap_in()
        self.lora_config = self._lora_configs[names[0]]

    def delete_adapter(self, adapter_name: str | list[str]) -> None:
        """Delete an adapter (or several: transformers' form). Deleting the active one makes the
        first remaining adapter active, as PEFT does, or leaves the model without adapters."""
        for name in [adapter_name] if isinstance(adapter_name, str) else list(adapter_name):
            if name not in self._lora_adapters:
                raise ValueError(f"no adapter named {name!r}; the adapters are {self.adapter_names}")
            if name in self._active_adapters:
                self._check_unmerged("delete_adapter")  # its merge would stay in the weights
                self._swap_out()
                self._active_adapters = [n for n in self._active_adapters if n != name]
                self._swap_in()
                self.lora_config = self._lora_configs[self._active_adapters[0]] if self._active_adapters else None
            del self._lora_adapters[name], self._lora_configs[name]
            if not self._active_adapters and self._lora_adapters:
                self.set_adapter(next(iter(self._lora_adapters)))

    def save_pretrained(self, save_directory: str | os.PathLike, *, selected_adapters: list[str] | None = None,
                        is_main_process: bool = True, state_dict: dict[str, torch.Tensor] | None = None,
                        **ignored: Any) -> None:
        """Write the adapters in PEFT's layout: ``"default"`` into ``save_directory``, any other into
        ``save_directory/<name>`` (PEFT's ``PeftModel.save_pretrained``). Only on the main process.
        ``state_dict`` is refused: the adapters are read from the model (other transformers saving
        options, such as ``safe_serialization``, do not apply: adapters are always safetensors)."""
        if state_dict is not None:
            raise ValueError("save_pretrained of a model with torch_wgpu_lora adapters writes the adapters from the "
                             "model itself; a state_dict (from DeepSpeed or FSDP) is not supported")
        if not is_main_process:
            return
        names = self.adapter_names if selected_adapters is None else list(selected_adapters)
        unknown = [n for n in names if n not in self._lora_adapters]
        if unknown:
            raise ValueError(f"selected_adapters {unknown} are not adapters of this model; they are {self.adapter_names}")
        active = self._active_adapters
        try:
            for name in names:
                self.set_adapter(name)
                folder = Path(save_directory) if name == DEFAULT_ADAPTER else Path(save_directory) / name
                adapter_files.save_adapter(self, folder)
        finally:
            if active:
                self.set_adapter(active)

    # -- several adapters in one batch (PEFT's adapter_names) ----------------------------------

    def __call__(self, *args: Any, adapter_names: list[str] | None = None, **kwargs: Any) -> Any:
        """The model's forward; with ``adapter_names`` (one name a row of the batch, ``"__base__"``
        for none) each row runs with its own adapter, as in PEFT's mixed batches (``per_row_adapters``)."""
        if adapter_names is None:
            return super().__call__(*args, **kwargs)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None:
            raise ValueError("adapter_names gives one adapter a row of the batch: pass input_ids or inputs_embeds")
        with self.per_row_adapters(adapter_names, len(ids)):
            return super().__call__(*args, **kwargs)

    def generate(self, *args: Any, adapter_names: list[str] | None = None, **kwargs: Any) -> Any:
        """transformers' ``generate``; with ``adapter_names`` (one name an input row, ``"__base__"`` for
        none) each row is generated with its own adapter, as PEFT's ``generate`` does. Rows that
        beam search or ``num_return_sequences`` repeat keep their row's adapter."""
        if adapter_names is None:
            return super().generate(*args, **kwargs)
        config = kwargs.get("generation_config") or self.generation_config
        copies = max(kwargs.get("num_beams", config.num_beams) or 1,
                     kwargs.get("num_return_sequences", config.num_return_sequences) or 1)
        if isinstance(adapter_names, (list, tuple)):
            adapter_names = [name for name in adapter_names for _ in range(copies)]
        ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None:
            raise ValueError("adapter_names gives one adapter a row of the batch: pass input_ids or inputs_embeds")
        with self.per_row_adapters(adapter_names, copies * len(ids)):
            return super().generate(*args, **kwargs)

    @contextmanager
    def per_row_adapters(self, adapter_names: list[str], rows: int) -> Iterator[None]:
        """Within the context, row i of a batch of ``rows`` runs with adapter ``adapter_names[i]``
        (``"__base__"``: no adapter), whichever adapters are active, as PEFT's ``adapter_names``:
        every adapted module becomes a ``PerRowLoRA`` for the duration. For inference only, as in
        PEFT: refused in training mode, with merged adapters, and for names of no adapter. Inside
        ``disable_adapter()`` every row runs the base model, as in PEFT."""
        if not isinstance(adapter_names, (list, tuple)) or not all(isinstance(n, str) for n in adapter_names):
            raise TypeError(f"adapter_names must be a list of adapter names, one a row, got {adapter_names!r}")
        if len(adapter_names) != rows:
            raise ValueError(f"adapter_names has {len(adapter_names)} names for a batch of {rows} rows; give one a row "
                             f"({BASE_ROW!r} for a row without adapter)")
        if self.training:
            raise ValueError("adapter_names is for inference (as in PEFT): call model.eval() first")
        unknown = sorted({n for n in adapter_names if n != BASE_ROW} - set(self._lora_adapters))
        if unknown:
            raise ValueError(f"adapter_names names no adapter of this model: {unknown}; the adapters are "
                             f"{self.adapter_names} (and {BASE_ROW!r} for a row without adapter)")
        self._check_unmerged("adapter_names")
        sites = {name for modules in self._lora_adapters.values() for name in modules}
        placed = {name: self.get_submodule(name) for name in sites}
        disabled = any(m.disabled for m in self.modules() if isinstance(m, LoRALinear))
        used = {id(m): m for n in set(adapter_names) - {BASE_ROW} for m in self._lora_adapters[n].values()}
        modes = {key: m.training for key, m in used.items()}
        try:
            for m in used.values():
                m.eval()  # a kept-aside adapter keeps the mode it last had in the model
            for name in sites:
                row_modules = [None if disabled or n == BASE_ROW else self._lora_adapters[n].get(name)
                               for n in adapter_names]
                self.set_submodule(name, PerRowLoRA(bitnet.base_layer(placed[name]), row_modules))
            yield
        finally:
            for name, module in placed.items():
                self.set_submodule(name, module)
            for key, m in used.items():
                m.train(modes[key])

    # -- merging (exact on the dense flavour only) ----------------------------------------------

    def merge_adapter(self, adapter_names: list[str] | None = None, safe_merge: bool = False) -> None:
        """Fold the active adapters (``adapter_names``: those of them, by default all) into the base
        weights, as PEFT's ``merge_adapter``; the model then computes the same without running them.
        Exact on the dense flavour (``nn.Linear`` projections) up to float rounding. On the quantised
        flavours it is refused, saying why (``_refuse_quantised_merge``). A merge that would put
        non-finite values into a weight is always refused before anything is written (``safe_merge``,
        PEFT's option for that check, is accepted and changes nothing)."""
        names = self.active_adapters if adapter_names is None else adapter_names
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"adapter_names must be a list of adapter names, got {adapter_names!r}")
        inactive = [n for n in names if n not in self._active_adapters]
        if inactive:
            raise ValueError(f"merge_adapter merges active adapters; {inactive} are not active (the active ones: "
                             f"{self.active_adapters}); set_adapter them first")
        modules = [(site, m) for site, by_adapter in self._active_sites().items()
                   for adapter, m in by_adapter.items() if adapter in names and not m.merged]
        for site, m in modules:
            if type(m.base_layer) is not nn.Linear:
                _refuse_quantised_merge(site, m.base_layer)
        for _, m in modules:
            m.merge()

    def unmerge_adapter(self) -> None:
        """Take every merged adapter out of the base weights again (PEFT's ``unmerge_adapter``): up to
        float rounding, the weights are the base model's again and the adapters run as before."""
        for by_adapter in self._active_sites().values():
            for m in by_adapter.values():
                if m.merged:
                    m.unmerge()

    def merge_and_unload(self, progressbar: bool = False, safe_merge: bool = False,
                         adapter_names: list[str] | None = None) -> nn.Module:
        """``merge_adapter(adapter_names)``, then ``unload()``: the base model with the adapters folded
        into its weights, as PEFT's ``merge_and_unload`` returns it (dense flavour only, exact up to
        float rounding; on the quantised flavours refused, saying why). ``progressbar`` is accepted
        and ignored (the merge is quick)."""
        self.merge_adapter(adapter_names, safe_merge=safe_merge)
        return self.unload()

    def unload(self) -> nn.Module:
        """The base model back, every adapter removed without merging (PEFT's ``unload``; adapters
        merged before stay in the weights): its projections are the base layers again, its class
        its own (``BitNetForCausalLM``), and it no longer has this API. Any flavour. Returns the
        model (changed in place, as PEFT's ``unload`` changes the model it wraps)."""
        self._swap_out()
        cls = next(c for c in type(self).__mro__[1:] if c is not LoraModelMixin and not issubclass(c, LoraModelMixin))
        del self._lora_adapters, self._lora_configs, self._active_adapters
        if "lora_config" in self.__dict__:
            del self.lora_config
        self.__class__ = cls
        return self

    def get_base_model(self) -> nn.Module:
        """The transformers model under the adapters (PEFT's ``get_base_model``). Here that model is
        this one, adapters in place, as ``PeftModel.get_base_model()`` returns the model holding
        PEFT's layers; ``unload()`` takes the adapters out."""
        return self

    # -- the adapters kept aside ---------------------------------------------------------------

    def _check_new_name(self, adapter_name: Any) -> None:
        if not isinstance(adapter_name, str) or not adapter_name or adapter_name in (".", "..") or "/" in adapter_name:
            raise ValueError(f"adapter_name must be a non-empty name usable as a folder name, got {adapter_name!r}")
        if adapter_name in self._lora_adapters:
            raise ValueError(f"an adapter named {adapter_name!r} already exists; delete_adapter it first or choose "
                             "another name")

    def _swap_out(self) -> None:
        """Put the base layers back in place of the active adapters' modules."""
        for name, modules in self._active_sites().items():
            self.set_submodule(name, next(iter(modules.values())).base_layer)

    def _swap_in(self) -> None:
        """Put the active adapters' modules in place of their base layers: an adapter alone on a
        module as it is, several on one module as a ``LoRASum``."""
        for name, modules in self._active_sites().items():
            placed = next(iter(modules.values())) if len(modules) == 1 else LoRASum(modules)
            self.set_submodule(name, placed.train(self.training))

    def _active_sites(self) -> dict[str, dict[str, LoRALinear]]:
        """Each module the active adapters adapt, by qualified name: their LoRALinear modules there, by adapter."""
        sites: dict[str, dict[str, LoRALinear]] = {}
        for adapter in self._active_adapters:
            for name, module in self._lora_adapters[adapter].items():
                sites.setdefault(name, {})[adapter] = module
        return sites

    def _check_unmerged(self, action: str) -> None:
        merged = [n for n, modules in self._active_sites().items() if any(m.merged for m in modules.values())]
        if merged:
            raise ValueError(f"{action}: the active adapters are merged into the base weights (e.g. of {merged[0]}); "
                             "call unmerge_adapter() first")

    @contextmanager
    def _bare(self) -> Iterator[None]:
        """The model without its active adapter for the duration (where new adapters are made); then the
        active adapter (perhaps the new one, when there was none) in place, and its config."""
        self._swap_out()
        try:
            yield
        finally:
            for name, module in bitnet.lora_modules(self).items():  # the new adapter (kept aside by _take_new)
                self.set_submodule(name, module.base_layer)
            self._swap_in()
            self.lora_config = self._lora_configs[self._active_adapters[0]] if self._active_adapters else None

    def _take_new(self, adapter_name: str) -> None:
        """Keep the adapter just applied to the bare model as ``adapter_name`` (``_bare`` takes it out)."""
        modules = bitnet.lora_modules(self)
        self._lora_adapters[adapter_name] = dict(modules)
        self._lora_configs[adapter_name] = getattr(self, "lora_config", None)
        if not self._active_adapters:  # the first adapter of a model without one is the one in use
            self._active_adapters = [adapter_name]


def _refuse_quantised_merge(site: str, layer: nn.Module) -> None:
    """ValueError saying why an adapter on the quantised ``layer`` (module ``site``) cannot be merged,
    and how to serve it instead."""
    # transformers' class (the packed BitLinear is our STE subclass of it: the name users know is its base's)
    kind = next((c.__name__ for c in type(layer).__mro__ if c.__module__.startswith("transformers.")),
                type(layer).__name__)
    if getattr(layer, "online_quant", False):
        held = f"{kind} (the online flavour) ternarises its weight W on every forward"
    else:
        held = f"{kind} (the packed flavour) holds W as ternary values and a scale"
    raise ValueError(
        f"{site}: cannot merge the adapter exactly. {held}; W + scaling·B·A is no longer ternary, so quantising it "
        "again would give a model that computes something else than the base model with its adapter. Only the "
        "dense flavour (nn.Linear projections) merges exactly. Serve the adapter beside the base model instead: "
        "model.save_pretrained(folder) writes it in PEFT's layout, which PeftModel.from_pretrained(base, folder) "
        "or transformers' base.load_adapter(folder) runs on this checkpoint; twl.save_adapter(model, "
        "'adapter.gguf', format='gguf') writes a LoRA GGUF that llama.cpp applies with --lora")


_CLASSES: dict[type, type] = {}


def with_adapter_api(model: nn.Module, adapter_name: str = DEFAULT_ADAPTER) -> nn.Module:
    """Give ``model``, which holds torch_wgpu_lora adapters, PEFT's model API (``LoraModelMixin``),
    its adapters being ``adapter_name``; returns ``model`` (its class changed in place)."""
    if isinstance(model, LoraModelMixin):
        return model
    cls = type(model)
    if cls not in _CLASSES:
        name = f"{cls.__name__}WithLoRA"
        _CLASSES[cls] = type(name, (LoraModelMixin, cls), {"__module__": __name__, "__qualname__": name,
                                                           "__doc__": f"{cls.__name__} with LoraModelMixin's methods."})
        globals()[name] = _CLASSES[cls]  # found by name, so that the model pickles
    model.__class__ = _CLASSES[cls]
    model._lora_adapters = {adapter_name: dict(bitnet.lora_modules(model))}
    model._lora_configs = {adapter_name: getattr(model, "lora_config", None)}
    model._active_adapters = [adapter_name]
    return model


def apply_lora(model: nn.Module, config: Any = None, adapter_name: str = DEFAULT_ADAPTER, **fields: Any) -> nn.Module:
    """Put LoRA adapters on ``model`` (``integrations.bitnet.add_lora_layers``; ``config``: ours or a
    ``peft.LoraConfig``, ``fields`` replacing its values), then give it PEFT's model API
    (``LoraModelMixin``), the adapter named ``adapter_name``; returns ``model``.

    >>> # model = apply_lora(load_bitnet(folder), peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    """
    bitnet.add_lora_layers(model, config, **fields)
    return with_adapter_api(model, adapter_name)


def load_adapter(model: nn.Module, path: str | os.PathLike, format: str | None = None, *,
                 residual_base: bool = False) -> nn.Module:
    """Load the adapter at ``path`` (a PEFT folder or a Hesper file) into ``model``
    (``integrations.adapter_files.load_adapter_file``), then give ``model`` PEFT's model API
    (``LoraModelMixin``) when it was loaded into a model without adapters; returns ``model``.

    >>> # model = load_adapter(load_bitnet(folder), "run/adapter")
    """
    had_adapters = bool(bitnet.lora_modules(model))
    adapter_files.load_adapter_file(model, path, format, residual_base=residual_base)
    return model if had_adapters else with_adapter_api(model)


# -- PEFT models ----------------------------------------------------------------------------------

def peft_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every PEFT tuner layer in ``model`` (LoRA layers, ``modules_to_save``
    wrappers, ...); none when peft was never imported (no model can hold one then)."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None:
        return []
    return [(name, module) for name, module in model.named_modules() if isinstance(module, tuners.BaseTunerLayer)]


def _lora_linear_class() -> type | None:
    module = sys.modules.get("peft.tuners.lora.layer")
    return None if module is None else module.Linear


def _check_peft_layer(name: str, layer: nn.Module) -> str:
    """The active adapter of PEFT layer ``name``, after checking it is plain LoRA on a linear layer."""
    if type(layer) is not _lora_linear_class():
        raise ValueError(f"{name} is a PEFT {type(layer).__module__}.{type(layer).__name__}; torch_wgpu_lora runs "
                         "LoRA on linear layers only (peft.tuners.lora.layer.Linear)")
    active = list(layer.active_adapters)
    if len(active) != 1 or active[0] not in layer.lora_A:
        raise ValueError(f"{name}: PEFT layer with active adapters {active}; torch_wgpu_lora runs exactly one")
    adapter = active[0]
    problems = {
        "its adapters are merged into the base weight (unmerge them first)": layer.merged,
        "its adapters are disabled (leave the disable_adapter context first)": layer.disable_adapters,
        "DoRA (use_dora)": layer.use_dora.get(adapter, False),
        "a bias on lora_B (lora_bias)": layer.lora_bias.get(adapter, False),
        "transposed base weights (fan_in_fan_out)": getattr(layer, "fan_in_fan_out", False),
        "a LoRA variant": getattr(layer, "lora_variant", {}).get(adapter) is not None,
    }
    for what, present in problems.items():
        if present:
            raise ValueError(f"{name} (PEFT adapter {adapter!r}): {what}, which torch_wgpu_lora does not run")
    a, b = layer.lora_A[adapter], layer.lora_B[adapter]
    if type(a) is not nn.Linear or type(b) is not nn.Linear or a.bias is not None or b.bias is not None:
        raise ValueError(f"{name} (PEFT adapter {adapter!r}): lora_A / lora_B are not bias-free nn.Linear layers")
    if a.weight.dtype != torch.float32 or b.weight.dtype != torch.float32:
        raise ValueError(f"{name} (PEFT adapter {adapter!r}): lora weights are {a.weight.dtype}; torch_wgpu_lora's "
                         "adapters are float32 (peft's default, autocast_adapter_dtype=True)")
    dropout = layer.lora_dropout[adapter]
    if type(dropout) not in (nn.Dropout, nn.Identity):
        raise ValueError(f"{name} (PEFT adapter {adapter!r}): lora_dropout is a {type(dropout).__name__}")
    return adapter


def from_peft(model: nn.Module, backend: str = "wgpu") -> nn.Module:
    """A transformers model holding torch_wgpu_lora's adapters that shares every tensor with ``model``, a
    ``PeftModel`` or a base model ``get_peft_model`` wrapped: each PEFT LoRA layer of the active adapter
    becomes a ``LoRALinear`` (adapters on ``backend``) holding the same base weights and the same
    ``lora_A`` / ``lora_B`` Parameters, so training the result trains ``model``'s adapter. ``model`` is
    left as it was. The result has PEFT's model API (``LoraModelMixin``) and ``BitNetEngine`` runs it.

    Refused, naming the module or the option: PEFT layers other than LoRA on linear layers, DoRA,
    biases, several active adapters, merged or disabled adapters, and (from a PeftModel's config)
    anything ``LoraConfig.from_peft_fields`` refuses. Adapters whose initialisation changed the base
    weights (PiSSA, ...) are fine: the result shares those changed weights.

    >>> # ours = from_peft(get_peft_model(base, peft.LoraConfig(target_modules=["q_proj", "v_proj"])))
    """
    config = None
    base = model
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and hasattr(model, "base_model") and hasattr(model.base_model, "model"):
        active = getattr(model, "active_adapter", None)
        if active not in peft_config:
            raise ValueError(f"the PeftModel's active adapter is {active!r}; torch_wgpu_lora runs exactly one adapter")
        fields = peft_config[active].to_dict()
        config = LoraConfig.from_peft_fields(fields, f"the PeftModel's adapter {active!r}", loading=True,
                                             residual_base=True)
        base = model.base_model.model
    layers = peft_layers(base)
    if not layers:
        raise ValueError(f"the {type(model).__name__} holds no PEFT layer: nothing to convert (apply_lora adds "
                         "torch_wgpu_lora's adapters)")
    if bitnet.lora_modules(base):
        raise ValueError("the model holds torch_wgpu_lora adapters as well as PEFT layers; convert a model with one kind")
    active = {name: _check_peft_layer(name, layer) for name, layer in layers}
    # A copy of the module tree whose Parameters and buffers are the original's own.
    shared = {id(t): t for t in (*base.parameters(), *base.buffers())}
    twin = copy.deepcopy(base, memo=shared)
    twin.requires_grad_(False)
    bitnet.use_ste_backward(twin)
    for name, layer in layers:
        adapter = active[name]
        copied = twin.get_submodule(name)
        module = LoRALinear(copied.base_layer, r=layer.r[adapter], lora_alpha=layer.lora_alpha[adapter],
                            init="peft", backend=backend, use_rslora=layer.use_rslora.get(adapter, False))
        module.lora_A = layer.lora_A[adapter].weight.requires_grad_(True)
        module.lora_B = layer.lora_B[adapter].weight.requires_grad_(True)
        module.lora_dropout = copy.deepcopy(layer.lora_dropout[adapter])
        module.scaling = float(layer.scaling[adapter])  # PEFT's, as set_scale may have changed it
        module.train(twin.training)
        twin.set_submodule(name, module)
    if config is not None:
        twin.lora_config = config.updated(backend=backend)
    return with_adapter_api(twin, getattr(model, "active_adapter", None) or next(iter(active.values())))
