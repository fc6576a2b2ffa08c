"""The model's LoRA adapters as the engine's kernels read them, kept equal to the torch Parameters.

Each decoder layer has four inputs that projections read, each produced by a norm kernel:

    site "attn"  (input_layernorm)          → q_proj, k_proj, v_proj   (one fused projection)
    site "o"     (attn_sub_norm)            → o_proj
    site "mlp"   (post_attention_layernorm) → gate_proj, up_proj       (one fused, rows interleaved)
    site "down"  (ffn_sub_norm)             → down_proj

Every adapter value lives in one flat float32 buffer, ``params``: per site, the A matrices
of its adapters stacked ([ranks, K64]: the norm kernel computes every h = A·x of the site
at once), then each adapter's B ([out, r], torch's own layout). Each region starts on a
256-byte boundary so kernels can bind it as a view. A site's projection gets a small
header table (``kernels.projection.lora_table``): a segment per adapter naming its output rows, its
columns of h, its scale and where its B lies in ``params``. Gradients, when training, use
the same layout in ``grads``, so one AdamW launch updates every adapter.

The Parameters are shared, not copied. Before every call ``sync`` compares each one with
the values last uploaded and writes those that changed (an optimizer step, ``load_adapter``,
any in-place edit), so the engine never drifts from them. When the engine itself updates
``params`` (training with the GPU optimizer), ``pull`` writes the values back.

The engine runs adapters (``LoRALinear``) on those seven projections of the decoder layers;
``check_adapters`` refuses, naming the module, any other adapter in the model (on ``lm_head``,
a PEFT layer, ...), which it would otherwise leave out. ``refresh`` follows the model when its
adapters change (another active adapter: other modules or ranks) by laying them out anew; a
disabled adapter (``LoRALinear.disabled``) runs with scaling 0.

Several adapters in one batch (PEFT's ``adapter_names``): ``refresh(serve_rows=True)`` lays out every named
adapter of the model at once, each with its slot (its index among the model's adapter names); a
site's ``columns`` (u32 [rank]) names the slot of each column of h, and a pass's rows name theirs
(``row_slots``), so that the norm kernel zeroes, in each token's h, the columns of the adapters the
token does not run (``kernels.norm``) and each projection adds the token's own adapter alone.

LoRA dropout (``dropout``): adapters in training mode with ``lora_dropout`` > 0 drop features
of their input with masks the kernels compute from a pass's seed and each adapter's key
(``kernels.dropout``); the engine takes one probability for every adapter, as a PEFT config has.

>>> # adapters = EngineAdapters(model, config, device); adapters.sync()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..integrations.bitnet import PROJECTIONS, base_layer, projection
from ..integrations.peft import BASE_ROW, peft_layers
from ..modules import LoRALinear, LoRASum
from ..runtime import Buffer, Device, Recorder, upload, write
from .config import WITHOUT_ENGINE, EngineConfig, pad
from .kernels.projection import lora_table
from .kernels.dropout import NO_SPLIT, SiteDropout, dropout_mask_reference, site_key

SITES = {"attn": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "mlp": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
_ALIGN = 64  # floats: 256 bytes, the largest offset alignment adapters ask of views
NO_ADAPTER = 0xFFFFFFFF  # the slot of a row that runs no adapter (PEFT's "__base__"): no column's


@dataclass
class Adapter:
    """One LoRALinear as the engine places it."""

    module: LoRALinear
    layer: int
    site: str  # its norm site (a key of SITES)
    name: str
    a_row: int  # first row of its A in the site's stacked A (= its first column of h)
    b_offset: int  # where its B [out, r] starts in ``params`` (floats)
    segment: int  # its header's index in the site's table
    rows: tuple[int, int, int]  # (first, end, step) of its output rows in the fused projection
    slot: int = 0  # serving rows: its named adapter's index among the model's


@dataclass
class Site:
    """One norm site of one layer: its stacked A (a view of ``params``) and the header table of
    the projection it feeds."""

    k: int
    rank: int  # total rank (rows of A, columns of h)
    a_offset: int  # floats into ``params``
    a: Buffer | None
    table: Buffer | None
    segments: int
    adapters: list[Adapter]
    columns: Buffer | None = None  # serving rows: u32 [rank], each column of h's adapter slot


def _scaling(module: LoRALinear) -> float:
    """The factor the kernels apply to an adapter's output: 0 while it is disabled."""
    return 0.0 if module.disabled else module.scaling


def rows_of(config: EngineConfig, name: str) -> tuple[int, int, int]:
    """(first row, end row, step) of a projection's outputs in its site's fused projection."""
    q, kv, f = config.q_size, config.kv_size, config.intermediate
    return {"q_proj": (0, q, 1), "k_proj": (q, q + kv, 1), "v_proj": (q + kv, q + 2 * kv, 1),
            "o_proj": (0, config.hidden, 1), "gate_proj": (0, 2 * f, 2), "up_proj": (1, 2 * f, 2),
            "down_proj": (0, config.hidden, 1)}[name]


def refuse_peft_layers(model: nn.Module) -> None:
    """ValueError naming the first PEFT layer in ``model`` (BitNetEngine runs torch_wgpu_lora's adapters)."""
    for name, module in peft_layers(model):
        raise ValueError(f"{name} is a PEFT layer ({type(module).__name__}), which BitNetEngine does not run; convert "
                         "the model with torch_wgpu_lora.integrations.peft.from_peft(model) (its adapters become "
                         f"torch_wgpu_lora's, sharing their Parameters), or {WITHOUT_ENGINE}")


def check_adapters(model: nn.Module, config: EngineConfig) -> None:
    """ValueError naming the first adapter of ``model`` that the engine cannot run: a PEFT layer, several
    adapters at once on one projection (a ``LoRASum``), or a ``LoRALinear`` anywhere but on the seven
    projections of the decoder layers (e.g. on ``lm_head``)."""
    refuse_peft_layers(model)
    runnable = {id(projection(layer, name)) for layer in model.model.layers[: config.layers] for name in PROJECTIONS}
    for name, module in model.named_modules():
        if isinstance(module, LoRASum):
            raise ValueError(f"{name} runs several adapters at once ({', '.join(module.names)}: set_adapter was given "
                             "a list), which BitNetEngine does not: it runs one adapter a projection. set_adapter(name), "
                             f"or {WITHOUT_ENGINE}")
        if isinstance(module, LoRALinear) and id(module) not in runnable:
            raise ValueError(f"{name} has a LoRA adapter, which BitNetEngine cannot run: it runs adapters on the "
                             f"decoder layers' projections ({', '.join(PROJECTIONS)}) only. Remove it, or "
                             f"{WITHOUT_ENGINE}")


Placed = tuple[str, LoRALinear, int]  # (projection name, adapter, slot)


def _layout(model: nn.Module, config: EngineConfig) -> list[list[Placed]]:
    """Per layer, the (projection name, adapter, slot 0) of each adapter the engine runs, in ``SITES`` order."""
    return [[(n, m, 0) for names in SITES.values() for n in names if isinstance(m := projection(layer, n), LoRALinear)]
            for layer in model.model.layers[: config.layers]]


def named_adapters(model: nn.Module) -> dict[str, dict[str, LoRALinear]]:
    """The model's adapters by name (``LoraModelMixin.named_adapters``), ValueError for a model without names."""
    if not callable(getattr(model, "named_adapters", None)):
        raise ValueError(f"adapter_names picks among a model's named adapters, and this {type(model).__name__} has "
                         "none (torch_wgpu_lora.apply_lora or load_adapter make a model that has them)")
    return model.named_adapters()


def _rows_layout(model: nn.Module, config: EngineConfig) -> list[list[Placed]]:
    """Per layer, (projection name, adapter, slot) of every named adapter of the model, in ``SITES``
    order, each projection's adapters in the order of their names; ValueError naming an adapter the
    engine cannot run (one off the decoder layers' projections)."""
    where = {id(base_layer(projection(layer, n))): (i, n)
             for i, layer in enumerate(model.model.layers[: config.layers]) for n in PROJECTIONS}
    layers: list[list[Placed]] = [[] for _ in range(config.layers)]
    for slot, (name, modules) in enumerate(named_adapters(model).items()):
        for path, m in modules.items():
            if id(m.base_layer) not in where:
                raise ValueError(f"adapter {name!r} adapts {path}, which BitNetEngine cannot run: it runs adapters on "
                                 f"the decoder layers' projections ({', '.join(PROJECTIONS)}) only. {WITHOUT_ENGINE}")
            i, n = where[id(m.base_layer)]
            layers[i].append((n, m, slot))
    order = [n for names in SITES.values() for n in names]
    return [sorted(placed, key=lambda p: (order.index(p[0]), p[2])) for placed in layers]


def _signature(layout: list[list[Placed]]) -> list[list[tuple]]:
    return [[(n, id(m), m.r, slot) for n, m, slot in layer] for layer in layout]


class EngineAdapters:
    """Every adapter of the model on the GPU, by layer and site, synced with the Parameters."""

    def __init__(self, model: nn.Module, config: EngineConfig, device: Device) -> None:
        self.model, self.config, self.device = model, config, device
        self.gpu_is_newer = False  # set when the engine's own optimizer step changed ``params``
        self._lay_out(_layout(model, config))

    def refresh(self, serve_rows: bool = False) -> bool:
        """Lay the adapters out anew if the model's changed since (other modules or ranks, e.g. after
        ``set_adapter``) or ``serve_rows`` differs from the last layout's; returns whether it did.
        ``serve_rows``: every named adapter of the model, each pass's rows choosing theirs
        (``row_slots``; PEFT's ``adapter_names``); else the adapters in use. Values the engine's
        optimizer wrote are pulled into the old Parameters first. Plans built for the old layout must
        not be used after a True."""
        layout = (_rows_layout if serve_rows else _layout)(self.model, self.config)
        if (serve_rows, _signature(layout)) == self._signature:
            return False
        if serve_rows:
            refuse_peft_layers(self.model)
        else:
            check_adapters(self.model, self.config)
        self.pull()
        self._lay_out(layout, serve_rows)
        return True

    def row_slots(self, adapter_names: Any, rows: int) -> list[int]:
        """Each row's adapter slot for ``adapter_names`` (one name a row, ``"__base__"`` for none, as
        PEFT takes them), checked as PEFT checks them: ValueError or TypeError saying what is wrong."""
        names = list(named_adapters(self.model))
        if not isinstance(adapter_names, (list, tuple)) or not all(isinstance(n, str) for n in adapter_names):
            raise TypeError(f"adapter_names must be a list of adapter names, one a row, got {adapter_names!r}")
        if len(adapter_names) != rows:
            raise ValueError(f"adapter_names has {len(adapter_names)} names for a batch of {rows} rows; give one a row "
                             f"({BASE_ROW!r} for a row without adapter)")
        if self.model.training:
            raise ValueError("adapter_names is for inference (as in PEFT): call model.eval() first")
        unknown = sorted({n for n in adapter_names if n != BASE_ROW} - set(names))
        if unknown:
            raise ValueError(f"adapter_names names no adapter of this model: {unknown}; the adapters are {names} "
                             f"(and {BASE_ROW!r} for a row without adapter)")
        return [NO_ADAPTER if n == BASE_ROW else names.index(n) for n in adapter_names]

    def _lay_out(self, layout: list[list[Placed]], serve_rows: bool = False) -> None:
        config = self.config
        self.serving_rows = serve_rows  # every named adapter laid out, each row choosing its own
        self._signature = (serve_rows, _signature(layout))
        self.sites: list[dict[str, Site]] = []
        size = 0
        for index, placed in enumerate(layout):
            sites = {}
            for site, names in SITES.items():
                k = config.intermediate if site == "down" else config.hidden
                modules = [(n, m, slot) for n, m, slot in placed if n in names]
                rank = sum(m.r for _, m, _ in modules)
                a_offset, size = size, size + pad(rank * pad(k, 64), _ALIGN)
                adapters, a_row = [], 0
                for n, m, slot in modules:
                    adapters.append(Adapter(m, index, site, n, a_row, size, len(adapters), rows_of(config, n), slot))
                    a_row += m.r
                    size += pad(m.lora_B.numel(), _ALIGN)
                sites[site] = Site(k, rank, a_offset, None, None, len(adapters), adapters)
            self.sites.append(sites)
        self.size = max(size, _ALIGN)
        self.params = Buffer((self.size,), device=self.device)
        self._grads: Buffer | None = None
        for sites in self.sites:
            for site in sites.values():
                if site.rank:
                    site.a = self.params.slice(site.a_offset, (site.rank, pad(site.k, 64)))
                    site.table = upload(lora_table(self._segments(site)), self.device)
                    if serve_rows:
                        site.columns = upload(np.array([a.slot for a in site.adapters for _ in range(a.module.r)],
                                                       np.uint32), self.device)
        self.modules = [a.module for sites in self.sites for s in sites.values() for a in s.adapters]
        self._uploaded: dict[int, torch.Tensor] = {}  # id(parameter) -> the values on the GPU
        self._scaling: dict[int, float] = {}  # id(module) -> the scaling in its segment header
        rec = Recorder(self.device)
        rec.clear(self.params)  # padding between regions reads as zero
        rec.submit()
        self.sync(force=True)

    @staticmethod
    def _segments(site: Site) -> list[tuple]:
        return [(*a.rows[:3], a.a_row, _scaling(a.module), a.b_offset, a.module.r) for a in site.adapters]

    @property
    def max_rank(self) -> int:
        return max((s.rank for sites in self.sites for s in sites.values()), default=0)

    @property
    def adapters(self) -> list[Adapter]:
        return [a for sites in self.sites for s in sites.values() for a in s.adapters]

    def roles(self) -> dict[str, int]:
        """Bytes of GPU memory the adapters hold: their values, their gradients (once made) and the
        projections' segment tables."""
        tables = sum(s.table.gpu.size for sites in self.sites for s in sites.values() if s.table is not None)
        out = {"values": self.params.gpu.size, "segment tables": tables}
        if self._grads is not None:
            out["gradients"] = self._grads.gpu.size
        return out

    def grads(self) -> Buffer:
        """The gradient buffer, laid out like ``params`` (made on first use)."""
        if self._grads is None:
            self._grads = Buffer((self.size,), device=self.device)
        return self._grads

    def dropout(self) -> float:
        """The LoRA dropout probability the adapters apply now: their ``lora_dropout`` in training
        mode, 0 in eval mode (as ``nn.Dropout``). Adapters that would drop with different
        probabilities are refused: the engine takes one for all.

        >>> # p = adapters.dropout()   # 0.05 after model.train() with lora_dropout=0.05, 0 after model.eval()
        """
        if self.serving_rows:
            return 0.0  # rows serving named adapters: inference (``row_slots`` refuses training mode)
        active = {}
        for a in self.adapters:
            d = a.module.lora_dropout
            if type(d) not in (nn.Dropout, nn.Identity):
                raise ValueError(f"layer {a.layer} {a.name}: lora_dropout is a {type(d).__name__}; BitNetEngine applies "
                                 "nn.Dropout (or nn.Identity) only")
            active[(a.layer, a.name)] = float(d.p) if type(d) is nn.Dropout and d.training else 0.0
        if len(set(active.values())) > 1:
            shown = ", ".join(f"layer {layer} {name}: {p}" for (layer, name), p in list(active.items())[:6])
            raise ValueError("BitNetEngine applies one LoRA dropout probability to every adapter; these differ "
                             f"(counting adapters in eval mode as 0): {shown}, ...")
        return next(iter(active.values()), 0.0)

    def dropout_masks(self, seed: int, rows: int) -> dict[LoRALinear, torch.Tensor]:
        """The masks the kernels apply to each adapter's input in a pass of ``rows`` token rows
        seeded with ``seed`` (0 where dropped, 1 / (1 − p) where kept; [rows, in_features]),
        computed in torch (``kernels.dropout.dropout_mask_reference``), for comparisons."""
        p = self.dropout()
        if not p:
            raise ValueError("the adapters apply no dropout (lora_dropout 0, or eval mode)")
        return {a.module: dropout_mask_reference(seed, site_key(a.layer, list(SITES).index(a.site)) + a.segment, rows,
                                                 self._site_of(a).k, p) for a in self.adapters}

    def site_dropout(self, layer: int, name: str, state: Buffer) -> SiteDropout | None:
        """The kernels' view of a site's dropout, its masks seeded from ``state``; None where the
        site has no adapter."""
        site = self.sites[layer][name]
        if not site.rank:
            return None
        rows = [a.a_row for a in site.adapters[1:]] + [NO_SPLIT, NO_SPLIT]
        return SiteDropout(state, site_key(layer, list(SITES).index(name)), (rows[0], rows[1]))

    def _changed(self, t: torch.Tensor) -> bool:
        last = self._uploaded.get(id(t))
        return last is None or not torch.equal(last, t.detach())

    def _site_of(self, adapter: Adapter) -> Site:
        return self.sites[adapter.layer][adapter.site]

    def sync(self, force: bool = False, pull: bool = True) -> int:
        """Upload every adapter tensor whose values changed since its last upload; returns how many.

        After the engine's own optimizer steps the GPU holds newer values than the Parameters:
        they are pulled first, so that torch code which goes on from this call (an autograd loss
        and a torch optimizer) sees them, and an edit made in torch since the last upload or
        pull still wins. ``pull=False`` (the engine's next optimizer step: nothing in torch reads
        the Parameters in between) skips the readback; the GPU's values stay and only a
        Parameter edited in torch since is uploaded. ``force`` uploads every Parameter."""
        if self.gpu_is_newer and pull and not force:
            self.pull()
        count = 0
        for adapter in self.adapters:
            m, site = adapter.module, self._site_of(adapter)
            if m.merged:
                raise ValueError(f"layer {adapter.layer} {adapter.name}: the adapter is merged into its base weight, "
                                 "which the engine has already uploaded; unmerge it")
            scaling = _scaling(m)
            if force or self._scaling.get(id(m)) != scaling:  # load_adapter may bring another alpha
                word = np.array([scaling], np.float32).view(np.uint32)
                write(site.table, word, offset=(8 * adapter.segment + 6) * 4)
                self._scaling[id(m)] = scaling
            if force or self._changed(m.lora_A):
                a = np.zeros((m.r, pad(site.k, 64)), np.float32)
                a[:, : site.k] = m.lora_A.detach().float().numpy()
                write(self.params, a, offset=4 * (site.a_offset + adapter.a_row * a.shape[1]))
                self._uploaded[id(m.lora_A)] = m.lora_A.detach().clone()
                count += 1
            if force or self._changed(m.lora_B):
                b = np.ascontiguousarray(m.lora_B.detach().float().numpy().reshape(-1))
                write(self.params, b, offset=4 * adapter.b_offset)
                self._uploaded[id(m.lora_B)] = m.lora_B.detach().clone()
                count += 1
        return count

    def read(self, buffer: Buffer, rec: Recorder) -> dict[torch.Tensor, torch.Tensor]:
        """Record reading ``buffer`` (``params`` or ``grads``) back as one tensor per Parameter:
        returns {parameter: values}, filled when ``rec`` is submitted."""
        out: dict[torch.Tensor, torch.Tensor] = {}
        where = []
        for adapter in self.adapters:
            m, site = adapter.module, self._site_of(adapter)
            where.append((m.lora_A, site.a_offset + adapter.a_row * pad(site.k, 64), pad(site.k, 64), site.k))
            where.append((m.lora_B, adapter.b_offset, m.lora_B.shape[1], m.lora_B.shape[1]))

        def sink(flat: np.ndarray) -> None:
            for param, offset, stride, width in where:
                rows = param.shape[0]
                out[param] = torch.from_numpy(flat[offset: offset + rows * stride].reshape(rows, stride)[:, :width].copy())

        rec.read(buffer, sink)
        return out

    @torch.no_grad()
    def pull(self) -> None:
        """Write the GPU's adapter values into the Parameters (after the engine's optimizer steps).

        A Parameter that was changed in torch since its last upload keeps its new value (it will
        be uploaded by the next ``sync``). Each copy bumps the Parameter's version, as an optimizer
        step does."""
        if not self.gpu_is_newer:
            return
        rec = Recorder(self.device)
        values = self.read(self.params, rec)
        rec.submit()
        for param, value in values.items():
            if self._changed(param):
                continue
            param.copy_(value.to(param.dtype))
            self._uploaded[id(param)] = param.detach().clone()
        self.gpu_is_newer = False

    def views(self, buffers: tuple[Buffer, ...]) -> dict[torch.Tensor, tuple]:
        """For each Parameter, ("rows4" or "flat", its view in each of ``buffers``): flat buffers laid
        out like ``params`` (optimizer moments) seen per Parameter."""
        out = {}
        for adapter in self.adapters:
            m, site = adapter.module, self._site_of(adapter)
            width = pad(site.k, 64)
            a_at, b_at = site.a_offset + adapter.a_row * width, adapter.b_offset
            out[m.lora_A] = ("rows4", *(b.slice(a_at, (m.r, width)) for b in buffers))
            out[m.lora_B] = ("flat", *(b.slice(b_at, (m.lora_B.numel(),)) for b in buffers))
        return out
