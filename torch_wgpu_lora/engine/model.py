"""``BitNetEngine``: a transformers ``BitNetForCausalLM`` run whole on WebGPU.

>>> # model = load_bitnet("bitnet-b1.58-2B-4T"); apply_lora(model)
>>> # engine = BitNetEngine(model)                 # uploads the frozen weights once
>>> # out = engine(input_ids, attention_mask=mask, labels=labels)
>>> # out.logits, out.loss                         # like transformers' CausalLMOutputWithPast
>>> # engine.generate(input_ids, attention_mask=mask, max_new_tokens=32)  # like transformers' generate
>>> # engine.generate_batch(GenerationRequest([[1, 17, 42], [1, 5]], max_new_tokens=32))  # token ids in and out

The engine shares the model's LoRA Parameters (it does not copy them): whatever changes them
(a torch optimizer, ``load_adapter``, an in-place edit) is uploaded before the next call. The
frozen base weights are read once, at construction: build a new engine after changing them.

Batches are right-padded: ``attention_mask`` rows are ones then zeros. Positions are 0, 1, …
for every sequence, as transformers numbers them without ``position_ids``.

Packed rows (several examples in each row, as ``training.data.pack`` makes them) come with
``position_ids`` and no ``attention_mask``: each row's position ids count 0, 1, … within each
example and restart at 0 where the next starts (padding after the last is one more example).
RoPE then rotates each token at its position id and each example attends to itself only, as
transformers does for such rows given ``use_cache=False`` (with a cache or an attention mask it
would attend across them); the loss is as for any batch. Rows may then be longer than the
context, so long as each example fits it.

Threads may share an engine: its GPU passes take turns (``engine.lock``), since each shape's plan
has one set of activation buffers and KV caches.

LoRA dropout applies as in torch: in training mode, to each adapter's input, with the
adapters' ``lora_dropout`` (one probability for all). Each pass draws its masks' seed from
torch's default generator (``torch.manual_seed`` makes a run repeatable); the masks come from
a hash of that seed, not from torch's own dropout stream (``kernels.dropout``).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..limits import check_context
from ..loss import causal_lm_loss
from ..runtime import Device, get_device
from ..runtime.buffers import pool_for, staging_for
from .adapters import EngineAdapters, check_adapters, refuse_peft_layers
from .config import WITHOUT_ENGINE, EngineConfig
from .generate import DecodeSession, GenerationRequest, Generated
from .generate_api import TransformersCall
from .inputs import check_inputs, check_prompts, pad_micro_batch
from .plan import ForwardPlan, KVCache
from .step import DEFAULT_BUCKET_BYTES, OptimizerStep, check_bucket_bytes
from .train_plan import TrainPlan
from .weights import EngineWeights, upload_weights
from .workspace import MemoryReport, MemoryRow, Workspace

_PLANS_KEPT = 4  # plans (shapes) kept ready; each holds its activations and caches


class BitNetEngine(nn.Module):
    """The whole BitNet forward on WebGPU, as an ``nn.Module`` holding the model it runs.

    ``engine(input_ids, attention_mask=None, labels=None)`` returns a transformers
    ``CausalLMOutputWithPast`` with ``logits`` (CPU float32, [batch, tokens, vocab]) and,
    given ``labels``, ``loss``. ``engine.model`` is the transformers model (its LoRA
    Parameters are the engine's: ``engine.parameters()`` yields them).
    """

    def __init__(self, model: nn.Module, device: Device | None = None) -> None:
        super().__init__()
        refuse_peft_layers(model)
        self.engine_config = EngineConfig.from_model(model)
        if self.engine_config.projection_norm_eps is not None:
            raise ValueError("BitNetEngine does not run BitLinear layers with their own RMSNorm "
                             f"(quantization_config.use_rms_norm); {WITHOUT_ENGINE}")
        check_adapters(model, self.engine_config)
        self.device = device or get_device()
        self.model = model
        self.weights: EngineWeights = upload_weights(model, self.engine_config, self.device)
        self.adapters = EngineAdapters(model, self.engine_config, self.device)
        self.scratch = Workspace(self.device)  # scratch shared by the plans, which run one at a time
        self._plans: OrderedDict[tuple, ForwardPlan | TrainPlan | DecodeSession] = OrderedDict()
        self.optimizer_step = OptimizerStep(self.adapters, Workspace(self.device))
        self.lock = threading.RLock()  # one GPU pass at a time: plans own their buffers
        # Torch code reading the Parameters after the engine's optimizer steps gets current values.
        # (Weak references: the model must not keep its engine, and its GPU memory, alive.)
        adapters, lock = weakref.ref(self.adapters), self.lock

        @torch.compiler.disable  # GPU readbacks, never traced into a graph
        def pull(*_: Any) -> None:
            live = adapters()
            if live is not None:
                with lock:
                    live.pull()

        model.register_forward_pre_hook(pull)
        model.register_state_dict_pre_hook(pull)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("BitNetEngine holds GPU buffers and cannot be copied or pickled: copy or save its "
                        "model (engine.model; adapters with save_adapter) and build a new BitNetEngine from it")

    @property
    def config(self) -> Any:
        """The transformers config of the model (as ``model.config``)."""
        return self.model.config

    @property
    def generation_config(self) -> Any:
        """The model's generation defaults (``model.generation_config``), which ``generate`` starts from."""
        return self.model.generation_config

    @staticmethod
    def can_generate() -> bool:
        """transformers' question to a model (its ``pipeline`` asks it): the engine has ``generate``."""
        return True

    def plan(self, batch: int, tokens: int, logits: str = "all", dropout: bool = False,
             packed: bool = False) -> ForwardPlan:
        """The forward plan for ``batch`` sequences of ``tokens`` positions (``packed``: rows of packed
        examples), built once, then reused."""
        def make() -> ForwardPlan:
            workspace = Workspace(self.device, shared=self.scratch)
            cache = KVCache(self.engine_config, batch, tokens, workspace, packed=packed)
            return ForwardPlan(self.weights, self.adapters, cache, tokens, logits=logits, dropout=dropout,
                               from_start=True, packed=packed, workspace=workspace)  # passes start at 0

        return self._cached(("forward", batch, tokens, logits, dropout, packed), make)

    def train_plan(self, batch: int, tokens: int, slots: int = 1, dropout: bool = False,
                   packed: bool = False) -> TrainPlan:
        """The forward + loss + backward plan for ``slots`` micro-batches of one shape (``packed``:
        rows of packed examples)."""
        return self._cached(("train", batch, tokens, slots, dropout, packed),
                            lambda: TrainPlan(self.weights, self.adapters, batch, tokens, slots, dropout, packed,
                                              scratch=self.scratch))

    def decode_session(self, batch: int, prompt_length: int, max_new_tokens: int, serve_rows: bool = False,
                       **sampling: Any) -> DecodeSession:
        """The KV cache, plans and sampling launches of a generation of ``batch`` prompts of up to
        ``prompt_length`` tokens, with this sampling (``engine.generate.DecodeSession``), built
        once, then reused: building one takes tens of ms. ``serve_rows``: every named adapter laid
        out, each row running the one its slot names (``EngineAdapters.refresh(serve_rows=True)``). Generation
        applies no LoRA dropout: adapters that would (training mode) are refused."""
        with self.lock:
            self._follow_adapters(serve_rows=serve_rows)
        if self.adapters.dropout():
            raise ValueError("BitNetEngine generates without LoRA dropout, and the adapters are in training mode "
                             "with lora_dropout > 0: call model.eval() first (torch_wgpu_lora.generate does)")
        return self._cached(("session", batch, prompt_length, max_new_tokens, tuple(sorted(sampling.items()))),
                            lambda: DecodeSession(self.weights, self.adapters, batch, prompt_length, max_new_tokens,
                                                  scratch=self.scratch, **sampling))

    def release_plans(self) -> None:
        """Drop every plan kept ready, and the optimizer step encoded ahead of its submit: their
        buffers go back to the runtime's pool. The next call builds what it needs again.

        >>> # engine.release_plans(); torch_wgpu_lora.runtime.buffers.pool_for(engine.device).release()
        """
        with self.lock:
            self.optimizer_step.discard_ahead()
            self._plans.clear()

    def _follow_adapters(self, serve_rows: bool = False) -> None:
        """Lay the adapters out anew when the model's changed (``EngineAdapters.refresh``), or when
        ``serve_rows`` (every named adapter, each row choosing its own) differs from the last call's:
        the plans, the step encoded ahead and the optimizer step's flat moments of the old layout go
        (the optimizers keep their moments, which move into the new layout at their next step)."""
        if self.adapters.refresh(serve_rows):
            self.release_plans()
            self.optimizer_step.release_moments()
            self.optimizer_step = OptimizerStep(self.adapters, Workspace(self.device))

    def _cached(self, key: tuple, make: Any) -> Any:
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make()
            while len(self._plans) > _PLANS_KEPT:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    @torch.compiler.disable  # the engine is its own WebGPU program: torch.compile runs it as it is
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, return_logits: bool | None = None,
                position_ids: torch.Tensor | None = None, **unused: Any) -> Any:
        """Logits (and the loss, given labels) of a right-padded batch, or with ``position_ids`` of
        packed rows (the module's docstring), computed on WebGPU.

        With labels, while autograd records and some adapter Parameter requires grad, the loss
        is differentiable by the adapters (``loss.backward()`` fills their ``.grad``): the engine
        then computes the adapters' gradients in the same submit as the loss, and the logits
        (a [batch, tokens, vocab] readback) are returned only when ``return_logits=True``.

        ``adapter_names`` (one adapter name a row, ``"__base__"`` for none, as PEFT takes them): each
        row runs its own adapter (``EngineAdapters.refresh(serve_rows=True)``), for inference, as in PEFT.
        """
        adapter_names = unused.get("adapter_names")
        if unused.get("use_cache") or unused.get("past_key_values") is not None or unused.get("cache") is not None:
            raise ValueError("BitNetEngine keeps its KV cache on the GPU; use torch_wgpu_lora.generate for decoding")
        if position_ids is not None and attention_mask is not None:
            raise ValueError("BitNetEngine takes packed rows as transformers does, with position_ids and no "
                             "attention_mask (transformers keeps each example to itself only without one; the "
                             "padding after a row's last example is one more example): drop the attention_mask")
        ids, lengths, positions = check_inputs(self.engine_config, input_ids, attention_mask, labels, position_ids)
        with self.lock:
            slots = self._serve_rows(adapter_names, len(ids))
        params = [p for m in self.adapters.modules for p in (m.lora_A, m.lora_B)]
        seed = _dropout_seed() if self.adapters.dropout() else None  # one pass's masks: the loss's and its logits'
        if labels is not None and torch.is_grad_enabled() and any(p.requires_grad for p in params) and slots is None:
            loss = _EngineLoss.apply(self, ids, labels.detach().cpu().long(), lengths, seed, positions, *params)
            logits = self._logits(ids, lengths, seed, positions) if return_logits else None
            return CausalLMOutputWithPast(loss=loss, logits=logits)
        logits = self._logits(ids, lengths, seed, positions, slots)
        loss = causal_lm_loss(logits, labels.cpu().long()) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _serve_rows(self, adapter_names: Any, rows: int) -> list[int] | None:
        """Lay the adapters out for this call (under the lock): with ``adapter_names``, every named
        adapter, and each row's slot returned (``EngineAdapters.row_slots``); without, the adapters
        in use, and None."""
        slots = self.adapters.row_slots(adapter_names, rows) if adapter_names is not None else None
        self._follow_adapters(serve_rows=slots is not None)
        return slots

    def _logits(self, ids: torch.Tensor, lengths: list[int], seed: int | None,
                positions: torch.Tensor | None, slots: list[int] | None = None) -> torch.Tensor:
        """The logits of a pass; with ``seed`` (dropout active), the adapters dropping with its masks;
        with ``positions``, of packed rows; with ``slots``, each row running its adapter slot."""
        batch, tokens = ids.shape
        with self.lock:
            plan = self.plan(batch, tokens, dropout=seed is not None, packed=positions is not None)
            return plan.run(ids, lengths, dropout=None if seed is None else (seed, self.adapters.dropout()),
                            positions=positions, row_slots=slots)

    def loss_and_grads(self, ids: torch.Tensor, labels: torch.Tensor, lengths: list[int],
                       codes: dict | None = None, dropout_seed: int | None = None,
                       positions: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, dict[torch.Tensor, torch.Tensor]]:
        """The mean loss over labelled tokens and every adapter Parameter's gradient of it, in one
        submit (what ``loss.backward()`` hands to autograd). ``codes``, a dict, receives the
        pass's int8 activation codes (``program.read_codes``' format) for comparisons. With LoRA
        dropout active (``adapters.dropout()``), ``dropout_seed`` seeds the masks (default: one
        drawn from torch's generator); ``adapters.dropout_masks`` gives them. ``positions``: the
        position ids of packed rows, as ``check_inputs`` returns them (with lengths of whole rows)."""
        with self.lock:
            batch, tokens = ids.shape
            p = self.adapters.dropout()
            plan = self.train_plan(batch, tokens, dropout=p > 0, packed=positions is not None)
            dropout = (_dropout_seed() if dropout_seed is None else dropout_seed, p) if p else None
            return plan.loss_and_grads(ids, labels, lengths, dropout=dropout, codes=codes, positions=positions)

    # -- generation ---------------------------------------------------------------------------------

    def generate_batch(self, request: GenerationRequest) -> list[Generated]:
        """Up to ``request.max_new_tokens`` after each of ``request.prompts``, ``request.batch_size`` of
        them at once on the GPU (default: all), a finished row taking the next prompt (continuous
        batching; ``engine.generate``: the KV cache, the next-token choice and the token history stay
        there; each prompt gets the tokens it gets alone); returns each prompt's ``Generated`` (new
        ids, whether an EOS token ended them), in order, each also handed to ``request.on_done`` as
        soon as it is complete.

        >>> # engine.generate_batch(GenerationRequest([[0, 17, 42], [0, 5]], max_new_tokens=32, eos={1}))
        >>> # engine.generate_batch(GenerationRequest(prompts, max_new_tokens=128, batch_size=64))
        """
        check_prompts(request.prompts, self.engine_config.vocab)
        limits = request.limits()
        batch_size = request.batch_size
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"batch_size must be an integer >= 1 (or None: every prompt at once), got {batch_size!r}")
        per_submit = request.tokens_per_submit
        if isinstance(per_submit, bool) or not isinstance(per_submit, int) or per_submit < 1:
            raise ValueError(f"tokens_per_submit must be an integer >= 1, got {per_submit!r}")
        seeds = [0] * len(limits) if request.seeds is None else list(request.seeds)
        if len(seeds) != len(limits):
            raise ValueError(f"{len(seeds)} seeds for {len(limits)} prompts")
        todo = [i for i, limit in enumerate(limits) if limit > 0]  # the others are done: no token asked for
        prompts = [request.prompts[i] for i in todo]
        context = self.engine_config.max_positions
        for i in todo:
            try:
                check_context(context, len(request.prompts[i]), limits[i])
            except ValueError as err:
                raise ValueError(f"prompt {i}: {err}") from None
        longest, most = max((len(p) for p in prompts), default=0), max(limits)
        if longest + most > context:
            raise ValueError(f"prompts of up to {longest} tokens and up to {most} new tokens share KV cache rows of "
                             f"{longest + most} positions, past the model's context of {context} "
                             "(max_position_embeddings): generate the longest prompts and the longest completions in "
                             "separate requests")
        results = [Generated([], False) for _ in request.prompts]
        on_token, on_done = request.on_token, request.on_done
        with self.lock:  # one GPU pass at a time
            names = request.adapter_names
            slots = self.adapters.row_slots(names, len(request.prompts)) if names is not None else None
            if on_done is not None:
                for i in sorted(set(range(len(limits))) - set(todo)):
                    on_done(i, results[i])
            if not todo:
                return results
            session = self.decode_session(min(batch_size or len(todo), len(todo)), longest, most,
                                          serve_rows=slots is not None, **request.sampling)
            done = session.generate(
                prompts, request.eos, seeds=[seeds[i] for i in todo], tokens_per_submit=per_submit,
                max_new_tokens=[limits[i] for i in todo],
                on_token=None if on_token is None else lambda j, token: on_token(todo[j], token),
                on_done=None if on_done is None else lambda j, generated: on_done(todo[j], generated),
                row_slots=None if slots is None else [slots[i] for i in todo])
        for i, generated in zip(todo, done):
            results[i] = generated
        return results

    def generate(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 generation_config: Any = None, streamer: Any = None, tokenizer: Any = None,
                 **kwargs: Any) -> torch.Tensor:
        """transformers' ``generate`` for a decoder-only model, every row of the batch generated at
        once on WebGPU: returns [batch, input + new tokens] like transformers. ``input_ids`` (or
        ``inputs=``), ``attention_mask`` (left or right padding), ``generation_config`` and keyword
        settings as transformers takes them; what is supported, and what is refused:
        ``engine.generate_api``, which translates them into a ``generate_batch`` request and its
        result into transformers' layout.

        >>> # out = engine.generate(**tokenizer(prompts, padding=True, return_tensors="pt"), max_new_tokens=32)
        """
        if input_ids is None:
            input_ids = kwargs.pop("inputs", None)
        call = TransformersCall.from_arguments(self.engine_config, getattr(self.model, "generation_config", None),
                                               input_ids, attention_mask, generation_config, streamer, tokenizer,
                                               kwargs)
        return call.output(self.generate_batch(call.request))

    # -- the fast path: a whole optimizer step in one submit (a few with a gradient exchange) ---------

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], optimizer: Any, max_grad_norm: float, *,
                   all_reduce: Callable[[torch.Tensor], Any] | None = None,
                   labelled_total: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, Any]:
        """One optimizer step in one command buffer: every micro-batch's forward, loss and
        backward (gradients accumulated, the loss weighted per labelled token over the whole
        step, as ``training.trainer.accumulate_gradients``), the global-norm clip, and the
        AdamW update of ``optimizer`` (a ``WgpuAdamW`` over this model's adapters), all on the
        GPU. One small readback: loss, labelled tokens, gradient norm and whether the step was
        skipped (a non-finite loss or norm leaves the adapters and moments untouched).

        Data-parallel training (one engine per process) passes ``all_reduce``, a function that
        sums a flat float32 CPU tensor over the processes in place (e.g. ``torch.distributed.
        all_reduce``), and ``labelled_total``, the step's labelled tokens summed over the
        processes (all-reduced before this call: every process scales its loss gradient by
        1 / ``labelled_total``, so the sum of their gradients is the one-process gradient of
        the whole global batch). The gradients are then exchanged while the backward runs, as
        DDP's buckets are (``engine.step``):

        1. the backward goes to the GPU in parts, one per bucket of layers of about
           ``bucket_bytes`` of gradients (the last layers first), each part reading its bucket
           back (the flat gradient buffer is laid out like ``adapters.params``, a few MB);
        2. while the GPU runs the next part, a thread of the step's own calls ``all_reduce`` on
           the bucket (one tensor each; the last one carries the loss sum too);
        3. once the last bucket is summed, the sums are written back over the GPU's gradients and
           the global-norm clip and AdamW run on them, as in the one-submit path.

        Every process then applies the same update to the same numbers; every process must pass
        the same ``bucket_bytes``, so that their buckets match. Without ``all_reduce`` the step is
        the one submit above (``labelled_total``, if given, still sets the scale).

        While the GPU runs a step, the host encodes the next one's command buffer (same shape,
        micro-batch count and ``max_grad_norm``; none of the step's values are in it: inputs,
        loss scale and AdamW's values are written before it is submitted), so a run of steps
        hides the encoding behind the GPU. A step of another shape discards it.

        Micro-batches are padded to one shape. Packed micro-batches (``training.data.collate``'s:
        with ``position_ids``, every one of the step's) train as packed rows (the module's
        docstring); their ``attention_mask`` only marks the padding, which is one more example.
        Returns {"loss", "tokens", "grad_norm", "skipped"} ("loss" and "tokens" over every process
        when ``all_reduce`` is given).
        """
        check_bucket_bytes(bucket_bytes)
        packed = sum("position_ids" in b for b in micro_batches)
        if packed not in (0, len(micro_batches)):
            raise ValueError(f"{packed} of the {len(micro_batches)} micro-batches hold packed rows (position_ids): "
                             "a step's micro-batches are all packed or none")
        with self.lock:
            self._follow_adapters()
            self.optimizer_step.check_optimizer(optimizer)
            p = self.adapters.dropout()
            self.adapters.sync(pull=False)  # the GPU's values are the newest: no readback before a step
            tokens = max(int(b["input_ids"].shape[1]) for b in micro_batches)
            batch = max(int(b["input_ids"].shape[0]) for b in micro_batches)
            plan = self.train_plan(batch, tokens, len(micro_batches), dropout=p > 0, packed=packed > 0)
            labelled = 0
            for slot, b in enumerate(micro_batches):
                ids, mask, labels, positions = pad_micro_batch(b, batch, tokens)
                ids, lengths, positions = check_inputs(self.engine_config, ids, mask, labels, positions)
                labelled += plan.write_inputs(slot, ids, labels, lengths, positions)
                if p:
                    plan.set_dropout(slot, _dropout_seed(), p)
            if labelled_total is not None:
                if isinstance(labelled_total, bool) or not isinstance(labelled_total, int) or labelled_total < labelled:
                    raise ValueError(f"labelled_total must be an integer >= this process's {labelled} labelled tokens, "
                                     f"got {labelled_total!r}")
                labelled = labelled_total
            if labelled == 0:
                raise ValueError("the micro-batches hold no labelled token: nothing to compute a loss on")
            return self.optimizer_step.run(plan, len(micro_batches), labelled, optimizer, max_grad_norm,
                                           all_reduce=all_reduce, bucket_bytes=bucket_bytes)

    # -- memory -----------------------------------------------------------------------------------

    def memory_report(self) -> MemoryReport:
        """The GPU memory this engine and the runtime hold, by owner and role, beside the runtime's
        count of what is allocated and its peak. ``print(engine.memory_report())`` shows the table.

        Rows: the frozen weights; the adapters (values, gradients, segment tables); the optimizer
        step's buffers; the scratch the plans share (with what they derive once from the weights: the
        ternary weights transposed for the input gradients on the matrix units); each plan kept (activations, what a training
        pass saves for its backward, gradients, KV caches, logits, inputs); and the runtime's own:
        freed buffers its pool keeps for reuse and readback staging buffers. What the runtime counts
        that no row names (other users of the device, e.g. the LoRA op's resident weights) is the
        last row, "unattributed".

        >>> # print(engine.memory_report())
        """
        rows = [MemoryRow("weights", "frozen weights", self.weights.arena.nbytes)]
        rows += [MemoryRow("adapters", role, n) for role, n in self.adapters.roles().items()]
        rows += [MemoryRow("optimizer step", role, n) for role, n in self.optimizer_step.workspace.roles().items()]
        rows += [MemoryRow("plans' shared scratch", role, n) for role, n in self.scratch.roles().items()]
        for key, plan in self._plans.items():
            rows += [MemoryRow(_plan_name(key), role, n) for role, n in plan.roles().items()]
        rows.append(MemoryRow("runtime", "freed buffers kept for reuse", pool_for(self.device).free_bytes))
        rows.append(MemoryRow("runtime", "readback staging", staging_for(self.device).kept_bytes))
        allocated = self.device.allocated
        rest = allocated - sum(r.nbytes for r in rows)
        rows.append(MemoryRow("runtime", "unattributed", rest))
        return MemoryReport(tuple(r for r in rows if r.nbytes), allocated, self.device.peak_allocated)


class _EngineLoss(torch.autograd.Function):
    """The engine's loss as an autograd node over the adapter Parameters. The gradients are
    computed with the loss (one submit, see ``BitNetEngine.loss_and_grads``); backward scales
    them by the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, engine: BitNetEngine, ids: torch.Tensor, labels: torch.Tensor, lengths: list[int],
                seed: int | None, positions: torch.Tensor | None, *params: torch.Tensor) -> torch.Tensor:
        loss, grads = engine.loss_and_grads(ids, labels, lengths, dropout_seed=seed, positions=positions)
        ctx.grads = [grads[p] for p in params]
        ctx.save_for_backward(*params)  # autograd then refuses a backward after a Parameter changed in place
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError("BitNetEngine's loss can be differentiated once: its gradients come from the "
                               "engine's backward kernels, which have no derivative of their own, so "
                               "create_graph=True (double backward, a gradient penalty) is not supported; "
                               f"for that, {WITHOUT_ENGINE}")
        ctx.saved_tensors  # noqa: B018 - the version check
        return (None, None, None, None, None, None, *(g * grad for g in ctx.grads))


def _plan_name(key: tuple) -> str:
    """A cached plan's name in the memory report, from its cache key."""
    kind, *shape = key
    if kind == "session":
        return f"generation {shape[0]}×({shape[1]}+{shape[2]}) tokens"
    batch, tokens, extra, dropout, packed = shape
    name = f"{kind} {batch}×{tokens}" + (f", {extra} micro-batches" if kind == "train" and extra > 1 else "")
    return name + (", packed" if packed else "") + (", dropout" if dropout else "")


def _dropout_seed() -> int:
    """A pass's dropout seed, drawn from torch's default generator (as torch's own dropout draws)."""
    return int(torch.randint(0, 2**32, (), dtype=torch.int64))


ENGINES = ("auto", "wgpu", "torch")


def choose_engine(model: nn.Module, engine: str = "auto") -> BitNetEngine | None:
    """The engine to run ``model`` on: ``"wgpu"`` a ``BitNetEngine`` (errors name what it cannot
    run), ``"torch"`` none (transformers' modules, adapters on their own backend), ``"auto"`` the
    engine when the adapter is a GPU and the engine can run the model, else none.

    Why not on a CPU adapter: there the engine's kernels, shaped for GPUs, run on the same cores
    as torch's own CPU kernels and lose to them (``benchmarks/RESULTS.md``, "On lavapipe", gives
    the figures). ``"wgpu"`` still runs the engine there (the tests do).

    >>> # runner = choose_engine(model, "auto") or model
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "torch":
        return None
    if isinstance(model, BitNetEngine):
        return model
    if engine == "auto" and get_device().is_cpu:
        return None
    try:
        return BitNetEngine(model)
    except ValueError:
        if engine == "wgpu":
            raise
        return None
