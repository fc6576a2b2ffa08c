"""The engine's kernels: one module per kernel family or algorithm (``attention/`` a package of
three), each with its launch builders and the torch reference of the same math beside them;
``projection`` holds what the two projection families share.

Conventions shared by every family:

* Activations are float32, row-major, token-major: ``[tokens, features]`` with tokens
  ordered batch-major (``b * T + t``).
* A family's builder returns ``runtime.Launch`` objects (bind groups built once). A plan
  builds them once per shape and records them on every step; nothing is allocated then.
  Builders that need buffers of their own take them from a ``workspace.Workspace`` (scratch
  shared by launches that run one after another, or buffers counted under a role).
* Values that change from step to step (positions, lengths, token ids) are never baked
  into uniforms: kernels read them from small storage buffers the plan writes once per
  step, or that other kernels update on the GPU (decoding several tokens per submit).
* The starts buffer (``u32 [batch]``) holds, per sequence, the absolute position of its first
  token in this pass (token ``i`` of sequence ``b`` is at ``starts[b] + i``: sequences of
  different lengths decode together); the lengths buffer (``u32 [batch]``) holds, per
  sequence, how many key positions are valid (cache included). A training pass's starts are 0.
* A packed pass (several examples in each row, as training packs them) also has a positions
  buffer (``u32 [batch·tokens]``): each token's position id, restarting at 0 where each example
  starts. RoPE rotates each token at it, and attention keeps each query to the keys of its own
  example (query ``i`` sees keys ``i - positions[i]`` to ``i``); the kernels take it as an
  override constant's variant (``PACKED``), so that passes without it run as they are.
"""

from ...runtime import Buffer, Device


def bound_positions(positions: Buffer | None, tokens: int, device: Device) -> Buffer:
    """The buffer a launch binds as its position ids: ``positions`` (u32, one per token of the
    ``tokens``), or where the pass is not packed a dummy (its kernel variant reads none)."""
    if positions is None:
        return dummy(device)
    if positions.dtype != "u32" or positions.numel < tokens:
        raise ValueError(f"positions must be u32 with one per token ({tokens}), got {positions.dtype} "
                         f"{positions.shape}")
    return positions


def dummy(device: Device, slot: str = "read") -> Buffer:
    """A small buffer bound where a kernel's optional input or output is unused. WebGPU forbids
    binding one buffer twice in a launch when either binding is writable, so each writable
    slot has its own."""
    return device.owned(f"engine_dummy_{slot}", lambda: Buffer((4,), device=device))
