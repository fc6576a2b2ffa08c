"""A forward pass of the whole model planned once per shape: every buffer allocated in the plan's
``Workspace``, every launch built once (bind groups and uniforms fixed) by the one emitter of
``program``, recorded on every call.

A pass processes ``tokens`` positions of each of ``batch`` sequences (a prompt, a batch's logits,
or one decoded token) against a ``KVCache`` that holds ``length`` positions. What changes between
calls lives in GPU buffers the plan binds: the token ids, each sequence's first position in the
pass (its start) and valid length, the latter two owned by the cache so that a prefill plan and a
decode plan of one generation share them. Activations are reused by every layer (a forward keeps
nothing for a backward).

A packed plan (``packed=True``: several examples in each row, position ids restarting at 0 at
each, as training packs them) also binds a positions buffer the caller writes with each pass:
RoPE rotates each token at its position id and attention keeps each example to itself.

>>> # plan = ForwardPlan(weights, adapters, KVCache(config, 2, 40, ws), tokens=40, scratch=engine.scratch)
>>> # logits = plan.run(ids, lengths)      # [2, 40, vocab] on the CPU
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..runtime import Buffer, Recorder, write
from .adapters import EngineAdapters
from .config import EngineConfig, pad
from .kernels.dropout import dropout_state
from .kernels.embedding import gather_rows_launch
from .program import LayerIO, PassContext, Program, SiteIO, emit_embedding, emit_final_norm, emit_head, emit_layer, \
    read_codes
from .weights import EngineWeights
from .workspace import Workspace

LOGITS = ("all", "last", "none")


class KVCache:
    """Keys and values of every layer for ``batch`` sequences of up to ``length`` positions, with
    the buffers that say where each sequence stands: ``starts`` (u32 [batch]: the first position
    of its next pass) and ``lengths`` (u32 [batch]: its valid positions, the next pass's included;
    0 marks a finished generation row, of which attention then reads one key).

    It holds ``nbytes(config, batch, length)`` of GPU memory, and each layer's keys (and values)
    are one storage binding: ``batch × kv_heads × length × head_dim`` float32s must fit the
    adapter's ``max_storage_buffer_binding_size`` (``max_batch`` says how many sequences do).
    ``packed``: its rows hold packed examples, whose positions restart at each, so a row may be
    longer than the model's context."""

    def __init__(self, config: EngineConfig, batch: int, length: int, workspace: Workspace,
                 packed: bool = False) -> None:
        if length < 1 or (length > config.max_positions and not packed):
            raise ValueError(f"a KV cache of {length} positions; the model takes 1 to {config.max_positions} "
                             "(max_position_embeddings)")
        most = KVCache.max_batch(config, length, workspace.device.max_binding)
        if not 1 <= batch <= most:
            raise ValueError(f"a KV cache of {batch} sequences of {length} positions; a layer's keys must fit one "
                             f"storage binding of {workspace.device.max_binding} bytes: at most {most} sequences")
        self.config, self.batch, self.length, self.device = config, batch, length, workspace.device
        shape = (batch, config.kv_heads, length, config.head_dim)
        self.keys = [workspace.alloc("KV cache", shape) for _ in range(config.layers)]
        self.values = [workspace.alloc("KV cache", shape) for _ in range(config.layers)]
        self.starts = workspace.alloc("inputs", (batch,), "u32")
        self.lengths = workspace.alloc("inputs", (batch,), "u32")

    def first_rows(self, count: int) -> "KVCache":
        """Its first ``count`` sequences, as a cache of their own over the same memory: a plan of
        those rows reads and writes theirs (a generation narrowed to its first rows)."""
        if not 1 <= count <= self.batch:
            raise ValueError(f"the first {count} sequences of a cache of {self.batch}")
        view = KVCache.__new__(KVCache)
        view.config, view.batch, view.length, view.device = self.config, count, self.length, self.device
        view.keys = [k.rows(0, count) for k in self.keys]
        view.values = [v.rows(0, count) for v in self.values]
        view.starts, view.lengths = self.starts.rows(0, count), self.lengths.rows(0, count)
        return view

    @staticmethod
    def nbytes(config: EngineConfig, batch: int, length: int) -> int:
        """Bytes of the keys and values of ``batch`` sequences of ``length`` positions.

        >>> # KVCache.nbytes(config, 16, 144)  # BitNet-2B: 2 × 30 layers × 16 × 5 × 144 × 128 × 4 = 354 MB
        """
        return 2 * config.layers * batch * config.kv_heads * length * config.head_dim * 4

    @staticmethod
    def max_batch(config: EngineConfig, length: int, max_binding: int) -> int:
        """The most sequences of ``length`` positions whose layer keys fit a binding of ``max_binding`` bytes."""
        return max_binding // (config.kv_heads * length * config.head_dim * 4)

    def set_position(self, starts: int | Sequence[int], lengths: Sequence[int]) -> None:
        """Write where the next pass stands: each sequence's first position (one int: every
        sequence's) and valid length."""
        starts = [starts] * self.batch if isinstance(starts, int) else list(starts)
        if len(lengths) != self.batch or not all(0 < n <= self.length for n in lengths):
            raise ValueError(f"lengths {lengths} for a cache of {self.batch} sequences × {self.length} positions")
        if len(starts) != self.batch or not all(0 <= s < self.length for s in starts):
            raise ValueError(f"starts {starts} for a cache of {self.batch} sequences × {self.length} positions")
        write(self.starts, np.asarray(starts, np.uint32))
        write(self.lengths, np.asarray(lengths, np.uint32))


class ForwardPlan:
    """Every buffer and launch of one forward pass shape.

    ``logits``: ``"all"`` positions ([batch·tokens, vocab]), ``"last"`` (each sequence's last
    position, [batch, vocab rounded up to 4]: generation; by default each sequence's row
    ``tokens - 1``, a right-padded batch's last real tokens after ``set_last``), or ``"none"``. ``decode``: few
    query tokens against a long cache (flash decoding) and, with ``fuse``, decoding's fusions
    (default: on GPUs; ``program``'s docstring). ``ids`` is a u32 [batch·tokens] buffer the caller writes, or another
    plan's (a sampler's next-token buffer). ``dropout``: the adapters apply LoRA dropout (a
    training-mode forward), with masks from the state ``set_dropout`` writes before each pass;
    decoding plans take none. ``from_start``: the caller promises that every pass starts at
    position 0 (a prompt, a batch's logits), so attention may keep its scores whole; such a plan
    run at another position gives NaN. ``batch_invariant``: each sequence's sums are the same
    whatever the batch (``PassContext``; a generation's prompt pass; float weights then project with
    GEMMs whatever the row count). ``packed``: each row holds several examples, their position ids
    (``positions``, u32 [batch·tokens]) written before each pass (``run`` takes them); not
    decoding. ``workspace``: the plan's own buffers (``scratch``, the engine's workspace of
    scratch shared between plans, if given).
    """

    def __init__(self, weights: EngineWeights, adapters: EngineAdapters, cache: KVCache, tokens: int,
                 logits: str = "all", decode: bool = False, ids: Buffer | None = None,
                 fuse: bool | None = None, dropout: bool = False, from_start: bool = False,
                 batch_invariant: bool = False, packed: bool = False, workspace: Workspace | None = None,
                 scratch: Workspace | None = None) -> None:
        if logits not in LOGITS:
            raise ValueError(f"logits must be one of {LOGITS}, got {logits!r}")
        if dropout and decode:
            raise ValueError("decoding plans apply no LoRA dropout")
        if packed and decode:
            raise ValueError("decoding plans continue one sequence a row: they take no packed rows")
        if from_start and decode:
            raise ValueError("decoding plans continue a cache: they cannot promise to start at position 0")
        config, device = weights.config, cache.device
        self.config, self.weights, self.adapters, self.cache = config, weights, adapters, cache
        self.tokens, self.batch, self.device = tokens, cache.batch, device
        self.workspace = ws = workspace or Workspace(device, shared=scratch)
        n = self.rows = cache.batch * tokens
        H, F = pad(config.hidden, 64), pad(config.intermediate, 64)
        quant = config.quantised
        self.ids = ids if ids is not None else ws.alloc("inputs", (n,), "u32")
        self.dropout = ws.alloc("inputs", (4,), "u32") if dropout else None
        self.positions = ws.alloc("inputs", (n,), "u32") if packed else None
        # rows serving named adapters (``EngineAdapters.refresh(serve_rows=True)``): each token's adapter slot
        self.row_adapters = ws.alloc("inputs", (n,), "u32") if adapters.serving_rows else None
        self.context = PassContext(
            weights, adapters, cache.batch, tokens, residual=ws.alloc("activations", (n, H)),
            qkv=ws.alloc("activations", (n, config.q_size + 2 * config.kv_size)),
            codes=ws.alloc("activations", (n, H // 4), "u32") if quant else None,
            ffn_codes=ws.alloc("activations", (n, F // 4), "u32") if quant else None,
            scales_and_sums=ws.alloc("activations", (2 * n,)) if quant else None, starts=cache.starts,
            lengths=cache.lengths, cache_length=cache.length, workspace=ws, decode=decode,
            fuse=not device.is_cpu if fuse is None else fuse,
            # float weights: a GEMV sums in another order than a GEMM, and a sequence alone may take the
            # one its batch does not (ternary weights' integer sums are the same on both paths)
            gemv=False if batch_invariant and not quant else None,
            from_start=from_start, batch_invariant=batch_invariant, dropout=self.dropout, positions=self.positions,
            row_adapters=self.row_adapters)
        xn, h = ws.alloc("activations", (n, H)), ws.alloc("activations", (n, max(adapters.max_rank, 1)))
        site = SiteIO(xn, h)
        queries, attention = ws.alloc("activations", (n, config.q_size)), ws.alloc("activations", (n, config.q_size))
        ffn = ws.alloc("activations", (n, F))
        down = SiteIO(ws.alloc("activations", (n, F)), h)
        self.layers = [LayerIO(site, site, site, down, queries, cache.keys[i], cache.values[i], attention, ffn)
                       for i in range(config.layers)]
        self.logits_mode = logits
        self.logits = self._logits_buffers(n, logits)
        self.last = None
        if logits == "last" and tokens > 1:
            self.last = ws.alloc("inputs", (cache.batch,), "u32")
            write(self.last, np.arange(cache.batch, dtype=np.uint32) * tokens + tokens - 1)
        self.program = Program()
        emit_embedding(self.program, self.context, self.ids)
        for index, io in enumerate(self.layers):
            emit_layer(self.program, self.context, index, io)
        self._emit_head(xn)

    def _logits_buffers(self, n: int, mode: str) -> list[tuple[int, Buffer]]:
        """(first row, buffer) chunks of the logits, each within one storage binding ("last": one
        buffer, rows of whole vec4s, as the sampler reads them)."""
        if mode == "none":
            return []
        vocab = self.config.vocab
        if mode == "last":
            width = pad(vocab, 4)
            if self.batch * width * 4 > self.device.max_binding:
                raise ValueError(f"{self.batch} sequences' last logits ({self.batch} × {width} float32s) exceed one "
                                 f"storage binding of {self.device.max_binding} bytes: at most "
                                 f"{self.device.max_binding // (4 * width)} sequences")
            return [(0, self.workspace.alloc("logits", (self.batch, width)))]
        per = max(1, self.device.max_binding // (4 * vocab))
        return [(r, self.workspace.alloc("logits", (min(per, n - r), vocab))) for r in range(0, n, per)]

    def _emit_head(self, xn: Buffer) -> None:
        if self.logits_mode == "none":
            return
        residual = self.context.residual
        if self.logits_mode == "last":  # each sequence's last position only
            rows = residual
            if self.last is not None:
                rows = self.workspace.alloc("activations", (self.batch, residual.shape[-1]))
                self.program.add(gather_rows_launch(self.last, residual, rows, tokens=self.batch,
                                                    k=residual.shape[-1], zero_missing=False, device=self.device))
            x = xn.rows(0, self.batch)
            emit_final_norm(self.program, self.context, rows, x, self.batch)
            self.program.add(*emit_head(self.context, x, self.logits[0][1], self.batch))
            return
        emit_final_norm(self.program, self.context, residual, xn, self.rows)
        for first, buf in self.logits:
            self.program.add(*emit_head(self.context, xn.rows(first, buf.shape[0]), buf, buf.shape[0]))

    # -- running ----------------------------------------------------------------------------------

    @property
    def launches(self) -> list:
        return self.program.launches

    @property
    def dispatches(self) -> int:
        return len(self.program)

    def record(self, rec: Recorder, capture: dict | None = None) -> None:
        """Record the whole pass (the caller has written ids, step and lengths); ``capture`` as
        ``Program.record``'s."""
        self.program.record(rec, capture)

    def set_last(self, lengths: Sequence[int]) -> None:
        """A ``"last"`` plan's rows to keep: each sequence's last real token, its ``lengths[b]``-th
        (a right-padded batch). With one token a pass, that token's row is the only one, and there
        is nothing to write."""
        if self.logits_mode != "last":
            raise ValueError(f"set_last names the rows of a plan that keeps the last logits; this one keeps "
                             f"{self.logits_mode!r}")
        if len(lengths) != self.batch or not all(1 <= n <= self.tokens for n in lengths):
            raise ValueError(f"lengths {list(lengths)} for a pass of {self.batch} sequences × {self.tokens} tokens")
        if self.last is not None:
            write(self.last, np.asarray([row * self.tokens + n - 1 for row, n in enumerate(lengths)], np.uint32))

    def set_dropout(self, seed: int, p: float) -> None:
        """The LoRA dropout of the next pass: masks from ``seed``, probability ``p``."""
        if self.dropout is None:
            raise ValueError("this plan was built without dropout (ForwardPlan(..., dropout=True))")
        write(self.dropout, dropout_state(seed, p))

    def set_row_slots(self, slots: Sequence[int]) -> None:
        """Each sequence's adapter slot (``EngineAdapters.row_slots``) for the passes that follow, in a
        plan whose adapters serve rows."""
        if self.row_adapters is None:
            raise ValueError("this plan runs the adapters in use on every row; its adapters were not laid out to "
                             "serve rows (EngineAdapters.refresh(serve_rows=True))")
        if len(slots) != self.batch:
            raise ValueError(f"{len(slots)} adapter slots for a pass of {self.batch} sequences")
        write(self.row_adapters, np.repeat(np.asarray(slots, np.uint32), self.tokens))

    def read_logits(self, rec: Recorder, out: np.ndarray) -> None:
        """After the pass, copy the logits into ``out`` (float32 [rows, vocab]; "last": a row a sequence)."""
        vocab = self.config.vocab
        for first, buf in self.logits:
            rec.read(buf, lambda view, at=first: np.copyto(out[at:at + view.shape[0]], view[:, :vocab]))

    def run(self, ids: torch.Tensor, lengths: list[int], dropout: tuple[int, float] | None = None,
            codes: dict | None = None, positions: torch.Tensor | None = None,
            row_slots: Sequence[int] | None = None) -> torch.Tensor | None:
        """Run one pass from position 0 over ``ids`` (int64 [batch, tokens], right-padded to
        ``lengths``): the adapters synced, the inputs written, the pass recorded and submitted; returns
        its logits [batch, tokens, vocab] (CPU float32) where the plan keeps every position's, else
        None. ``dropout``: (seed, probability) of the pass's LoRA dropout. ``codes``, a dict, receives
        the pass's int8 activation codes (``program.read_codes``' format), for comparisons.
        ``positions``: a packed plan's position ids (int64 [batch, tokens]: each row's examples one
        after another, each counting 0, 1, …, with ``lengths`` the whole rows). ``row_slots``: each
        sequence's adapter slot, in a plan whose adapters serve rows (``set_row_slots``)."""
        if self.logits_mode == "last":
            raise ValueError("run reads every position's logits or none; this plan keeps the last position's")
        if (positions is None) != (self.positions is None):
            raise ValueError("a packed plan runs with position_ids, and only a packed plan takes them")
        batch, tokens = ids.shape
        self.adapters.sync()
        if dropout is not None:
            self.set_dropout(*dropout)
        if positions is not None:
            write(self.positions, positions.numpy().astype(np.uint32).reshape(-1))
        if (row_slots is None) != (self.row_adapters is None):
            raise ValueError("a plan whose adapters serve rows runs with each row's adapter slot, and only such a "
                             "plan takes them")
        if row_slots is not None:
            self.set_row_slots(row_slots)
        write(self.ids, ids.numpy().astype(np.uint32).reshape(-1))
        self.cache.set_position(0, lengths)
        logits = torch.empty(batch * tokens, self.config.vocab, dtype=torch.float32) if self.logits else None
        capture = {} if codes is not None else None
        rec = Recorder(self.device)
        self.record(rec, capture)
        if logits is not None:
            self.read_logits(rec, logits.numpy())
        rec.submit()
        if codes is not None:
            codes.update(read_codes(capture, batch, tokens, self.config))
        return logits.reshape(batch, tokens, -1) if logits is not None else None

    def roles(self) -> dict[str, int]:
        """Bytes the plan's workspace holds, by role (its cache's when the cache is in it)."""
        return self.workspace.roles()
